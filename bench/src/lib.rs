//! Tether's bench library: the pure parts of `tether-bench` (the discrete-event cluster simulator, [`sim`], and the
//! summary statistics the study reports, [`stats`]) and the network-namespace link harness ([`netns`]). The binary
//! adds the rest of the I/O: real shards over QUIC, the floors and the study that writes `BENCHMARKS.md`.

pub mod netns;
pub mod sim;
pub mod stats;
