//! Prometheus metrics (names fixed in docs/design.md §6): the server's and the worker's metric sets, registered in a
//! `prometheus-client` registry, and a minimal HTTP exporter serving the text format at `/metrics`. Recording is a
//! few atomic operations and never blocks; the exporter runs on its own task and only reads.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Label set `{reason="..."}` / `{kind="..."}`.
pub type Labels = Vec<(&'static str, &'static str)>;

/// A float gauge.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Metrics a shard server exports.
#[derive(Clone)]
pub struct ServerMetrics {
    /// `tether_updates_applied_total`.
    pub updates_applied: Counter,
    /// `tether_updates_rejected_total{reason}`.
    pub updates_rejected: Family<Labels, Counter>,
    /// `tether_bytes_received_total{kind="wire"|"fp32"}`.
    pub bytes_received: Family<Labels, Counter>,
    /// `tether_staleness` (updates).
    pub staleness: Histogram,
    /// `tether_pull_wait_seconds`: time a pull was parked by the SSP gate.
    pub pull_wait: Histogram,
    /// `tether_workers_live`.
    pub workers_live: Gauge,
    /// `tether_checkpoint_seconds`: time to write the last checkpoint.
    pub checkpoint_seconds: FloatGauge,
    /// `tether_checkpoint_last_version`.
    pub checkpoint_last_version: Gauge,
    /// `tether_shard_version`: the shard's current version (its checkpoint age is this minus the last version).
    pub version: Gauge,
    /// `tether_rollbacks_total`: loss-spike rollbacks this shard carried out.
    pub rollbacks: Counter,
}

impl ServerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            updates_applied: Counter::default(),
            updates_rejected: Family::default(),
            bytes_received: Family::default(),
            staleness: Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 7.0, 15.0, 31.0, 63.0, 127.0]),
            pull_wait: Histogram::new(exponential_buckets(1e-4, 4.0, 10)),
            workers_live: Gauge::default(),
            checkpoint_seconds: FloatGauge::default(),
            checkpoint_last_version: Gauge::default(),
            version: Gauge::default(),
            rollbacks: Counter::default(),
        };
        registry.register(
            "tether_updates_applied",
            "Gradient updates applied",
            m.updates_applied.clone(),
        );
        registry.register(
            "tether_updates_rejected",
            "Pushes rejected, by reason",
            m.updates_rejected.clone(),
        );
        registry.register(
            "tether_bytes_received",
            "Push bytes received (wire) and their fp32 size",
            m.bytes_received.clone(),
        );
        registry.register(
            "tether_staleness",
            "Staleness of applied gradients in updates",
            m.staleness.clone(),
        );
        registry.register(
            "tether_pull_wait_seconds",
            "Time pulls waited at the SSP gate",
            m.pull_wait.clone(),
        );
        registry.register(
            "tether_workers_live",
            "Workers in the clock table",
            m.workers_live.clone(),
        );
        registry.register(
            "tether_checkpoint_seconds",
            "Duration of the last checkpoint write",
            m.checkpoint_seconds.clone(),
        );
        registry.register(
            "tether_checkpoint_last_version",
            "Version of the last checkpoint",
            m.checkpoint_last_version.clone(),
        );
        registry.register(
            "tether_shard_version",
            "Current shard version (updates applied over the shard's life, restored ones included)",
            m.version.clone(),
        );
        registry.register(
            "tether_rollbacks",
            "Loss-spike rollbacks to an in-memory snapshot",
            m.rollbacks.clone(),
        );
        m
    }
}

/// Metrics a worker exports.
#[derive(Clone)]
pub struct WorkerMetrics {
    /// `tether_worker_step_seconds`: one pull-compute-push step.
    pub step_seconds: Histogram,
    /// `tether_worker_loss`: the last training loss.
    pub loss: FloatGauge,
    /// `tether_worker_steps_total`.
    pub steps: Counter,
    /// `tether_worker_bytes_pushed_total{kind="wire"|"fp32"}`.
    pub bytes_pushed: Family<Labels, Counter>,
    /// `tether_worker_nonfinite_total`: gradients refused because they were not finite.
    pub nonfinite: Counter,
}

impl WorkerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            step_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 14)),
            loss: FloatGauge::default(),
            steps: Counter::default(),
            bytes_pushed: Family::default(),
            nonfinite: Counter::default(),
        };
        registry.register(
            "tether_worker_step_seconds",
            "Duration of one training step",
            m.step_seconds.clone(),
        );
        registry.register("tether_worker_loss", "Last training loss", m.loss.clone());
        registry.register(
            "tether_worker_steps",
            "Training steps completed",
            m.steps.clone(),
        );
        registry.register(
            "tether_worker_bytes_pushed",
            "Bytes pushed (wire) and their fp32 size",
            m.bytes_pushed.clone(),
        );
        registry.register(
            "tether_worker_nonfinite",
            "Non-finite gradients refused",
            m.nonfinite.clone(),
        );
        m
    }
}

/// Largest request head the exporter reads.
const MAX_REQUEST: usize = 8192;

/// Renders the registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// Serves `GET /metrics` on `addr` until the task is dropped; returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let registry = registry.clone();
            tokio::spawn(async move {
                // Read the whole request head (bounded in size and time): closing a socket with unread request
                // bytes makes the kernel answer with a reset, which the client sees instead of the response.
                let mut buf = [0u8; MAX_REQUEST];
                let mut n = 0;
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
                while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match tokio::time::timeout_at(deadline, sock.read(&mut buf[n..])).await {
                        Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                        Ok(Ok(k)) => n += k,
                    }
                }
                let req = String::from_utf8_lossy(&buf[..n]);
                let (status, body) = if req.starts_with("GET /metrics") {
                    ("200 OK", render(&registry))
                } else {
                    ("404 Not Found", "not found\n".to_string())
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(body.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Ok((local, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_metrics_render_with_contract_names() {
        let mut reg = Registry::default();
        let m = ServerMetrics::register(&mut reg);
        m.updates_applied.inc();
        m.updates_rejected
            .get_or_create(&vec![("reason", "replay")])
            .inc();
        m.bytes_received
            .get_or_create(&vec![("kind", "wire")])
            .inc_by(10);
        m.staleness.observe(2.0);
        m.workers_live.set(3);
        let text = render(&reg);
        for name in [
            "tether_updates_applied_total 1",
            "tether_updates_rejected_total{reason=\"replay\"} 1",
            "tether_bytes_received_total{kind=\"wire\"} 10",
            "tether_staleness_bucket",
            "tether_pull_wait_seconds_bucket",
            "tether_workers_live 3",
            "tether_checkpoint_seconds",
            "tether_checkpoint_last_version",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[tokio::test]
    async fn exporter_serves_metrics_over_http() {
        let mut reg = Registry::default();
        let m = WorkerMetrics::register(&mut reg);
        m.loss.set(0.25);
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), Arc::new(reg))
            .await
            .unwrap();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            s.read_to_string(&mut body),
        )
        .await
        .unwrap()
        .unwrap();
        task.abort();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("tether_worker_loss 0.25"), "{body}");
        assert!(body.contains("tether_worker_step_seconds_bucket"), "{body}");
    }
}
