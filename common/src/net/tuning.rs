//! Transport knobs (flow-control windows, stream limits, packet size, liveness), measured by
//! `examples/wire_bench.rs`.
//!
//! Defaults come from that bench on the shared 2-core dev machine (noisy: other builds were running): wide
//! windows (8 MiB per stream, 64 MiB per connection), 4 MiB socket buffers (a quarter of the packet losses of
//! the kernel default) and standard 1452-byte packets with GSO. Jumbo packets (path-MTU discovery to 8952, GSO
//! off) measured up to ~25% faster in one run, but with them the hostile-peer test saw stateless resets instead
//! of application close codes, so they stay opt-in until that is understood.

use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{FrameLimits, HEADER_LEN};

/// QUIC transport settings shared by servers and clients.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportTuning {
    /// Per-stream receive window, bytes (at least one whole bulk frame so a frame never waits on its stream).
    pub stream_receive_window: u64,
    /// Per-connection receive window, bytes.
    pub receive_window: u64,
    /// Per-connection send buffer, bytes.
    pub send_window: u64,
    /// Concurrent unidirectional streams the peer may open (one per bulk frame in flight).
    pub max_concurrent_uni_streams: u32,
    /// Concurrent bidirectional streams the peer may open (control channel).
    pub max_concurrent_bidi_streams: u32,
    /// Keep-alive ping interval (`None` = no pings).
    pub keep_alive_interval: Option<Duration>,
    /// Idle time after which a silent connection is dropped.
    pub idle_timeout: Duration,
    /// UDP payload size assumed from the start (≥ 1200; only raise it where the path is known to carry it).
    pub initial_mtu: u16,
    /// Largest UDP payload size path-MTU discovery probes for (`None` disables discovery).
    pub mtu_discovery_upper_bound: Option<u16>,
    /// Largest UDP payload this endpoint accepts, advertised to peers (caps their path-MTU discovery).
    pub max_udp_payload_size: u16,
    /// Generic segmentation offload (batching many packets per syscall).
    pub segmentation_offload: bool,
    /// UDP socket send/receive buffer to request (`None` = kernel default, about 208 KiB).
    pub socket_buffer_bytes: Option<usize>,
}

impl Default for TransportTuning {
    fn default() -> Self {
        TransportTuning {
            stream_receive_window: 8 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            max_concurrent_uni_streams: 256,
            max_concurrent_bidi_streams: 4,
            keep_alive_interval: Some(Duration::from_secs(2)),
            idle_timeout: Duration::from_secs(10),
            initial_mtu: 1200,
            mtu_discovery_upper_bound: Some(1452),
            max_udp_payload_size: 1472,
            segmentation_offload: true,
            socket_buffer_bytes: Some(4 << 20),
        }
    }
}

impl TransportTuning {
    /// The tuning of a worker's links under `cfg`: [`Self::for_failover`] when shards have standbys, the defaults
    /// otherwise.
    pub fn for_cluster(cfg: &crate::config::Config) -> Self {
        if cfg.cluster.replicated() {
            Self::for_failover(cfg.cluster.failover_ms)
        } else {
            Self::default()
        }
    }

    /// The defaults, with a link that stays silent for `failover_ms` counted as dead (keep-alives four times as
    /// often): for links to replicated shards, whose workers fail over, and for a standby's link to its primary.
    pub fn for_failover(failover_ms: u64) -> Self {
        let idle = std::time::Duration::from_millis(failover_ms.max(1));
        TransportTuning {
            idle_timeout: idle,
            keep_alive_interval: Some(idle / 4),
            ..TransportTuning::default()
        }
    }

    /// Widens the windows so that one bulk frame fits a stream window and several fit the connection window.
    pub fn sized_for(mut self, limits: &FrameLimits) -> Self {
        let frame = (limits.push.max(limits.params) + HEADER_LEN) as u64;
        self.stream_receive_window = self.stream_receive_window.max(frame);
        self.receive_window = self.receive_window.max(frame.saturating_mul(4));
        self.send_window = self.send_window.max(frame.saturating_mul(4));
        self
    }

    /// The quinn transport configuration for these settings.
    pub fn transport_config(&self) -> Arc<quinn::TransportConfig> {
        let clamp = |v: u64| quinn::VarInt::from_u64(v).unwrap_or(quinn::VarInt::MAX);
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(clamp(self.stream_receive_window))
            .receive_window(clamp(self.receive_window))
            .send_window(self.send_window)
            .max_concurrent_uni_streams(quinn::VarInt::from_u32(self.max_concurrent_uni_streams))
            .max_concurrent_bidi_streams(quinn::VarInt::from_u32(self.max_concurrent_bidi_streams))
            .keep_alive_interval(self.keep_alive_interval)
            .max_idle_timeout(quinn::IdleTimeout::try_from(self.idle_timeout).ok())
            .initial_mtu(self.initial_mtu.max(1200))
            .enable_segmentation_offload(self.segmentation_offload);
        match self.mtu_discovery_upper_bound {
            Some(upper) => {
                let mut mtu = quinn::MtuDiscoveryConfig::default();
                mtu.upper_bound(upper.max(self.initial_mtu.max(1200)));
                t.mtu_discovery_config(Some(mtu));
            }
            None => {
                t.mtu_discovery_config(None);
            }
        }
        Arc::new(t)
    }
}
