//! The AgentENV runtime node as a library.

pub mod backend;
pub mod reporter;
pub mod template;
