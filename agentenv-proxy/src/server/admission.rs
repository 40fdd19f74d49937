//! Admission of client connections: a cap on open connections in all and per
//! client address, so one client (or a flood of them) cannot take every file
//! descriptor and task of the gateway. A connection over a cap is answered
//! `503` with a JSON body and closed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Limits on client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// How long a client may take to send a complete request head, counted from
    /// the connection's start or the end of the previous response: idle
    /// keep-alive connections are closed after it as well.
    pub header_timeout: Duration,
    /// Open client connections at most, in all.
    pub max_connections: usize,
    /// Open client connections at most from one client address.
    pub max_connections_per_client: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            header_timeout: agentenv_core::serving::DEFAULT_HEADER_TIMEOUT,
            max_connections: 16_384,
            max_connections_per_client: 1_024,
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `max_connections` connections are open.
    Total,
    /// `max_connections_per_client` connections are open from this address.
    PerClient,
}

/// Open connections, in all and per client address.
#[derive(Debug)]
pub struct Admission {
    limits: ClientLimits,
    open: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// Holds a connection's place until dropped.
#[derive(Debug)]
pub struct Admitted {
    table: Arc<Admission>,
    client: IpAddr,
}

impl Admission {
    /// An empty table with `limits`.
    pub fn new(limits: ClientLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            open: Mutex::new(Counts::default()),
        })
    }

    /// Takes a place for a connection from `client`, or says which cap is reached.
    pub fn admit(self: &Arc<Self>, client: IpAddr) -> Result<Admitted, Refused> {
        let client = client.to_canonical();
        let mut open = self.open.lock();
        if open.total >= self.limits.max_connections {
            return Err(Refused::Total);
        }
        let n = open.per_client.entry(client).or_insert(0);
        if *n >= self.limits.max_connections_per_client {
            return Err(Refused::PerClient);
        }
        *n += 1;
        open.total += 1;
        Ok(Admitted {
            table: self.clone(),
            client,
        })
    }

    /// Connections open now, in all.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.lock().total
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.table.open.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.per_client.remove(&self.client);
            }
        }
    }
}

/// Answers a refused connection with `503` and closes it (bounded in time, so a
/// client that does not read cannot hold the task).
pub async fn refuse(mut stream: TcpStream, why: Refused) {
    let message = match why {
        Refused::Total => "the gateway is at its connection limit (max_connections): retry later",
        Refused::PerClient => {
            "too many open connections from this address (max_connections_per_client): close idle connections or retry later"
        }
    };
    let body = format!("{{\"code\":503,\"message\":\"{message}\"}}");
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(resp.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn caps_count_per_address_and_in_all_and_free_on_drop() {
        let t = Admission::new(ClientLimits {
            header_timeout: Duration::from_secs(1),
            max_connections: 3,
            max_connections_per_client: 2,
        });
        let a1 = t.admit(ip("10.0.0.1")).unwrap();
        let _a2 = t.admit(ip("10.0.0.1")).unwrap();
        assert_eq!(t.admit(ip("10.0.0.1")).unwrap_err(), Refused::PerClient);
        // The IPv4-mapped IPv6 form is the same client.
        assert_eq!(
            t.admit(ip("::ffff:10.0.0.1")).unwrap_err(),
            Refused::PerClient
        );
        let _b1 = t.admit(ip("10.0.0.2")).unwrap();
        assert_eq!(t.admit(ip("10.0.0.3")).unwrap_err(), Refused::Total);
        assert_eq!(t.open(), 3);
        drop(a1);
        assert_eq!(t.open(), 2);
        let _a3 = t.admit(ip("10.0.0.1")).unwrap();
    }
}
