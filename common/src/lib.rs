//! Tether shared core: the gradient codec, the wire protocol and transport, layout and configuration.

pub mod net;
pub mod pki;
pub mod protocol;
