//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use agentenv_guest::server::{AgentOptions, AgentState, serve};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// An agent served in-process on a loopback port.
pub struct TestAgent {
    pub addr: SocketAddr,
    pub state: Arc<AgentState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TestAgent {
    pub async fn start(opts: AgentOptions) -> TestAgent {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = AgentState::new(opts);
        let (tx, rx) = oneshot::channel();
        let st = state.clone();
        let task = tokio::spawn(async move {
            serve(listener, st, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        TestAgent {
            addr,
            state,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// Number of open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}
