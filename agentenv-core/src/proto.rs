//! Generated protobuf types and gRPC stubs.

/// `scheduler.v1`: the scheduler's gRPC API shared by gateway, scheduler and nodes.
pub mod scheduler_v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("scheduler.v1");
}
