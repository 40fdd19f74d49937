//! The AgentENV runtime node as a library.

pub mod backend;
pub mod template;
