//! The in-sandbox agent of AgentENV, envd-compatible.
