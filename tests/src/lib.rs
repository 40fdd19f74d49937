//! Helpers of the cross-process tests: start the real binaries on loopback.
