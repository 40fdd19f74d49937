//! The web console served by the gateway at `/console`.

#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod assets;
