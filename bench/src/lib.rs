//! Tether's bench library: the pure parts of `tether-bench` (the discrete-event cluster simulator, [`sim`], and the
//! summary statistics the study reports, [`stats`]) the network-namespace link harness ([`netns`])
//! the many-worker runs on it ([`scale`]) and a star held up while peers run on it ([`hosts`]). The binary
//! adds the rest of the I/O: real shards over QUIC, the floors and the study that writes `BENCHMARKS.md`.

pub mod hosts;
pub mod netns;
pub mod predict;
pub mod scale;
pub mod sim;
pub mod stats;
