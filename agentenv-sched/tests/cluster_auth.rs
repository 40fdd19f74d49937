//! The cluster credential over real gRPC on loopback: calls without it are
//! refused with UNAUTHENTICATED and change nothing; with it they work; the
//! read-only lookups can be opened by configuration.

mod support;

use agentenv_core::cluster_auth::{ClusterToken, SendClusterToken};
use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::Scheduler;
use agentenv_sched::auth::ClusterAuth;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const TOKEN: &str = "cluster-token-0123456789abcdef0123456789";
const SANDBOX: &str = "01936f8e-72f5-7000-8000-0000000000a1";

type Client = SchedulerClient<InterceptedService<Channel, SendClusterToken>>;

/// A scheduler for node-a on a loopback port, checking `TOKEN`.
async fn start(open_lookups: bool) -> std::net::SocketAddr {
    let config = SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: "http://127.0.0.1:1".into(),
        }],
        ..SchedulerConfig::default()
    };
    let sched = Scheduler::builder(config)
        .cluster_auth(ClusterAuth {
            token: Some(ClusterToken::new(TOKEN, "test").unwrap()),
            open_lookups,
        })
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        sched
            .serve(listener, std::future::pending::<()>())
            .await
            .unwrap();
    });
    addr
}

async fn client(addr: std::net::SocketAddr, token: Option<&str>) -> Client {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let token = token.map(|t| ClusterToken::new(t, "test").unwrap());
    SchedulerClient::with_interceptor(channel, SendClusterToken(token))
}

/// node-a's heartbeat listing `sandboxes`.
fn beat(sandboxes: &[&str]) -> HeartbeatRequest {
    support::beat("node-a", sandboxes)
}

async fn lookup(c: &mut Client) -> Result<String, Code> {
    c.lookup_node(LookupNodeRequest {
        sandbox_id: SANDBOX.into(),
    })
    .await
    .map(|r| r.into_inner().node.unwrap().node_id)
    .map_err(|s| s.code())
}

#[tokio::test]
async fn a_heartbeat_without_the_credential_is_refused_and_changes_no_binding() {
    let addr = start(false).await;
    let mut node = client(addr, Some(TOKEN)).await;
    node.heartbeat(beat(&[SANDBOX])).await.unwrap();
    assert_eq!(lookup(&mut node).await.unwrap(), "node-a");

    // A stranger claims node-a has no sandbox left.
    let mut stranger = client(addr, None).await;
    let err = stranger.heartbeat(beat(&[])).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(
        err.message().contains("cluster_token_file"),
        "the refusal names the setting: {}",
        err.message()
    );
    let mut wrong = client(addr, Some("not-the-cluster-token-0123456789abcdef")).await;
    let err = wrong.heartbeat(beat(&[])).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    for call in [
        stranger
            .unregister_node(UnregisterNodeRequest {
                node_id: "node-a".into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        stranger
            .record_assignment(RecordAssignmentRequest {
                sandbox_id: SANDBOX.into(),
                node: Some(Node {
                    node_id: "evil".into(),
                    endpoint: "http://10.9.9.9:8000".into(),
                }),
            })
            .await
            .map(|_| ()),
    ] {
        assert_eq!(call.unwrap_err().code(), Code::Unauthenticated);
    }
    // Lookups are closed too unless opened.
    assert_eq!(
        lookup(&mut stranger).await.unwrap_err(),
        Code::Unauthenticated
    );

    // The binding is exactly as the real node left it.
    assert_eq!(lookup(&mut node).await.unwrap(), "node-a");
}

#[tokio::test]
async fn open_lookups_answer_lookups_but_not_writes_without_the_credential() {
    let addr = start(true).await;
    let mut node = client(addr, Some(TOKEN)).await;
    node.heartbeat(beat(&[SANDBOX])).await.unwrap();
    let mut anyone = client(addr, None).await;
    assert_eq!(lookup(&mut anyone).await.unwrap(), "node-a");
    assert!(anyone.schedule(ScheduleRequest::default()).await.is_ok());
    let err = anyone.heartbeat(beat(&[])).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert_eq!(lookup(&mut anyone).await.unwrap(), "node-a");
}

#[tokio::test]
async fn drain_needs_the_credential_even_with_open_lookups() {
    let addr = start(true).await;
    let mut node = client(addr, Some(TOKEN)).await;
    node.heartbeat(beat(&[])).await.unwrap();
    let mut anyone = client(addr, None).await;
    let drain = DrainNodeRequest {
        node_id: "node-a".into(),
    };
    let err = anyone.drain_node(drain.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let err = anyone
        .undrain_node(UndrainNodeRequest {
            node_id: "node-a".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    // Nothing changed: node-a still takes placements.
    assert!(anyone.schedule(ScheduleRequest::default()).await.is_ok());

    let r = node.drain_node(drain).await.unwrap().into_inner();
    assert_eq!(
        r.node.unwrap().snapshot.unwrap().status,
        NodeStatus::Draining as i32
    );
    let err = anyone
        .schedule(ScheduleRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
}
