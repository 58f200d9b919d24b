//! Tether's bench library: the pure parts of `tether-bench` — the discrete-event cluster simulator ([`sim`]) and the
//! summary statistics the study reports ([`stats`]). The binary adds the I/O: real shards over QUIC, the floors,
//! the network-namespace link harness and the study that writes `BENCHMARKS.md`.

pub mod sim;
pub mod stats;
