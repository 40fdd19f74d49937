//! `filesystem.Filesystem` calls: stat, list, make a directory, remove.

use crate::proto::filesystem as fs;

use super::transport::{ClientError, GuestClient};

impl GuestClient {
    /// `Filesystem/Stat`.
    pub async fn stat(&self, path: &str) -> Result<fs::EntryInfo, ClientError> {
        let r: fs::StatResponse = self
            .unary(
                "/filesystem.Filesystem/Stat",
                &fs::StatRequest { path: path.into() },
            )
            .await?;
        r.entry.ok_or_else(|| ClientError::Protocol {
            path: "/filesystem.Filesystem/Stat".into(),
            reason: "no entry in the response".into(),
        })
    }

    /// `Filesystem/ListDir`.
    pub async fn list_dir(
        &self,
        path: &str,
        depth: u32,
    ) -> Result<Vec<fs::EntryInfo>, ClientError> {
        let r: fs::ListDirResponse = self
            .unary(
                "/filesystem.Filesystem/ListDir",
                &fs::ListDirRequest {
                    path: path.into(),
                    depth,
                },
            )
            .await?;
        Ok(r.entries)
    }

    /// `Filesystem/MakeDir`.
    pub async fn make_dir(&self, path: &str) -> Result<(), ClientError> {
        let _: fs::MakeDirResponse = self
            .unary(
                "/filesystem.Filesystem/MakeDir",
                &fs::MakeDirRequest { path: path.into() },
            )
            .await?;
        Ok(())
    }

    /// `Filesystem/Remove`.
    pub async fn remove(&self, path: &str) -> Result<(), ClientError> {
        let _: fs::RemoveResponse = self
            .unary(
                "/filesystem.Filesystem/Remove",
                &fs::RemoveRequest { path: path.into() },
            )
            .await?;
        Ok(())
    }
}
