//! Peer addresses as `cluster.toml` gives them (`host:port`): resolving one to a socket address, and the host part a
//! peer's certificate must name. A leaf module shared by the shard server, the fence's links and the witness.

use std::net::SocketAddr;

use crate::error::Error;

/// The host part of `host:port` (brackets of an IPv6 literal removed): the TLS name a peer's certificate must carry.
pub(crate) fn host_of(addr: &str) -> String {
    addr.rsplit_once(':')
        .map_or(addr, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// Parses `host:port` (resolving names) into a socket address.
pub fn resolve(addr: &str) -> Result<SocketAddr, Error> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map_err(|e| Error::Address(format!("cannot resolve {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Address(format!("{addr:?} resolves to no address")))
}
