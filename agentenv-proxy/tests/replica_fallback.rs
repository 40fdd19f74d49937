//! The gateway's scheduler client with a query-only replica: lookups go to
//! the replica, fall back to the primary while the replica cannot be reached,
//! and return to the replica once it answers again. The primary and the
//! replica keep separate bindings here, so an answer tells who was asked.

use std::net::SocketAddr;
use std::sync::Arc;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::Node;
use agentenv_proxy::{GrpcSchedulerClient, SchedulerClient};
use agentenv_sched::{BindingStore, MemoryBindingStore, Scheduler};
use agentenv_testkit::eventually;
use agentenv_testkit::redis::RedisServer;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Duration, Instant};
use tonic::Code;

fn node() -> Node {
    Node {
        node_id: "node-a".into(),
        endpoint: "http://127.0.0.1:1".into(),
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: node().endpoint,
        }],
        ..SchedulerConfig::default()
    }
}

/// A scheduler with its own in-memory bindings holding `ids`.
async fn scheduler(query_only: bool, ids: &[&str]) -> Scheduler {
    let store = Arc::new(MemoryBindingStore::new(Duration::from_secs(600)));
    for id in ids {
        store.record(id, &node(), Instant::now()).await.unwrap();
    }
    Scheduler::builder(config())
        .query_only(query_only)
        .binding_store(store)
        .build()
        .unwrap()
}

struct Served {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Served {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

async fn serve_on(s: Scheduler, addr: &str) -> Served {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        s.serve(listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap()
    });
    Served { addr, stop, task }
}

async fn found_by(client: &GrpcSchedulerClient, id: &str) -> Result<String, Code> {
    client
        .lookup_node(id)
        .await
        .map(|n| n.node_id)
        .map_err(|s| s.code())
}

#[tokio::test]
async fn lookups_fall_back_to_the_primary_while_the_replica_is_down_and_return_after() {
    let primary = serve_on(scheduler(false, &["in-primary"]).await, "127.0.0.1:0").await;
    let replica = serve_on(scheduler(true, &["in-replica"]).await, "127.0.0.1:0").await;
    let replica_addr = replica.addr;
    let client =
        GrpcSchedulerClient::connect_lazy(&primary.addr.to_string(), &replica_addr.to_string())
            .unwrap();
    assert_eq!(
        found_by(&client, "in-replica").await.as_deref(),
        Ok("node-a")
    );
    assert_eq!(
        found_by(&client, "in-primary").await,
        Err(Code::NotFound),
        "a NOT_FOUND from the replica is the answer"
    );

    replica.stop().await;
    assert_eq!(
        found_by(&client, "in-primary").await.as_deref(),
        Ok("node-a"),
        "asked the primary"
    );
    assert_eq!(found_by(&client, "in-replica").await, Err(Code::NotFound));

    let _replica = serve_on(
        scheduler(true, &["in-replica"]).await,
        &replica_addr.to_string(),
    )
    .await;
    eventually(
        "lookups to go to the replica again",
        Duration::from_secs(30),
        || async { found_by(&client, "in-replica").await.ok() },
    )
    .await;
    primary.stop().await;
}

#[tokio::test]
async fn a_hanging_replica_gives_way_to_the_primary() {
    let primary = serve_on(scheduler(false, &["sbx"]).await, "127.0.0.1:0").await;
    // Accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = GrpcSchedulerClient::connect_lazy(
        &primary.addr.to_string(),
        &silent.local_addr().unwrap().to_string(),
    )
    .unwrap();
    assert_eq!(found_by(&client, "sbx").await.as_deref(), Ok("node-a"));
    // Marked down: the next lookup goes straight to the primary.
    assert_eq!(found_by(&client, "sbx").await.as_deref(), Ok("node-a"));
    primary.stop().await;
}

#[tokio::test]
async fn a_replica_whose_store_is_down_hands_the_lookup_to_the_primary() {
    let mut redis = RedisServer::start();
    let primary = serve_on(scheduler(false, &["sbx"]).await, "127.0.0.1:0").await;
    let replica = Scheduler::builder(SchedulerConfig {
        redis_addr: redis.addr(),
        ..config()
    })
    .query_only(true)
    .build_async()
    .await
    .unwrap();
    let replica = serve_on(replica, "127.0.0.1:0").await;
    redis.kill();
    let client =
        GrpcSchedulerClient::connect_lazy(&primary.addr.to_string(), &replica.addr.to_string())
            .unwrap();
    // The primary knows the binding it wrote; what it does not know is its answer too.
    assert_eq!(found_by(&client, "sbx").await.as_deref(), Ok("node-a"));
    let err = client.lookup_node("other").await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    primary.stop().await;
    replica.stop().await;
}

#[tokio::test]
async fn with_both_down_the_primarys_error_names_it() {
    let closed = |_: ()| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (primary, replica) = (closed(()), closed(()));
    let client = GrpcSchedulerClient::connect_lazy(&primary, &replica).unwrap();
    let err = client.lookup_node("sbx").await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(
        err.message().starts_with("scheduler unreachable: ") && err.message().contains(&primary),
        "{}",
        err.message()
    );
}
