//! The AgentENV gateway as a library.
