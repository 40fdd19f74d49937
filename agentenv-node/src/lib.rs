//! The AgentENV runtime node as a library.
