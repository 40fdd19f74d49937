//! The AgentENV scheduler as a library.
