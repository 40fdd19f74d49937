//! Helpers shared by the unit tests of this crate.

use agentenv_core::proto::scheduler_v1::Node;

/// Node `id` with the endpoint `http://<id>:8000`.
pub(crate) fn node(id: &str) -> Node {
    Node {
        node_id: id.into(),
        endpoint: format!("http://{id}:8000"),
    }
}
