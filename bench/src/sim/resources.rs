//! The simulator's resources: FIFO servers (a CPU, one direction of a NIC), a transfer through two of them
//! pipelined (cut-through), and a pool of cores shared by every CPU job. Reservations are greedy and never preempted: a
//! job reserved at `t` starts when its resource is free and runs its whole duration.

/// A FIFO resource: reserving `d` seconds from `t` starts when it is free.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Fifo {
    pub(super) free: f64,
    pub(super) busy: f64,
}

impl Fifo {
    /// Reserves `d` seconds from `t`; when it ends.
    pub(super) fn reserve(&mut self, t: f64, d: f64) -> f64 {
        let start = self.free.max(t);
        self.free = start + d;
        self.busy += d;
        self.free
    }
}

/// Moves one message through the sender's egress and then the receiver's ingress, each a FIFO at the link rate,
/// pipelined (cut-through): the bytes leave the sender as soon as its egress is free, and the receiver's ingress
/// takes them as they come, once it is free, never faster than they left. A busy receiver therefore delays only its
/// own messages, never the sender's next one to another host (each host's link is shaped per direction, with its
/// own queue: `tc tbf` on both ends of its veth). Returns when the last byte is in.
pub(super) fn transfer(out: &mut Fifo, inn: &mut Fifo, t: f64, d: f64) -> f64 {
    let sent = out.reserve(t, d);
    let start = (sent - d).max(inn.free);
    let end = (start + d).max(sent);
    inn.busy += d;
    inn.free = end;
    end
}

/// Cores shared by every CPU activity (each activity also holds its own node's serial `Fifo`): a job arriving at
/// `t` takes the core that frees first, in arrival order.
pub(super) struct Pool {
    pub(super) free: Vec<f64>,
}

impl Pool {
    /// Runs `d` seconds on the first free core and on `serial`; when it ends.
    pub(super) fn run(&mut self, t: f64, d: f64, serial: &mut Fifo) -> f64 {
        let (i, f) = self
            .free
            .iter()
            .copied()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        let start = t.max(f).max(serial.free);
        let end = start + d;
        if let Some(c) = self.free.get_mut(i) {
            *c = end;
        }
        serial.free = end;
        serial.busy += d;
        end
    }
}

/// Runs `d` seconds of CPU on `serial` (a node's own CPU), on the shared pool when there is one.
pub(super) fn cpu(pool: &mut Option<Pool>, serial: &mut Fifo, t: f64, d: f64) -> f64 {
    match pool {
        Some(p) => p.run(t, d, serial),
        None => serial.reserve(t, d),
    }
}

/// One host's NIC: a FIFO per direction.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Nic {
    pub(super) out: Fifo,
    pub(super) inn: Fifo,
}

/// Moves `d` seconds of bytes from host `from` to host `to` starting at `t`; when the last byte left. A side given as
/// `None` is free (a counterfactual) and holds nothing; traffic within one host holds no NIC.
pub(super) fn send(
    nics: &mut [Nic],
    from: Option<usize>,
    to: Option<usize>,
    t: f64,
    d: f64,
) -> f64 {
    match (from, to) {
        (Some(a), Some(b)) if a == b => t,
        (Some(a), Some(b)) => {
            // a ≠ b: split the slice so that both NICs can be borrowed at once.
            let (lo, hi) = nics.split_at_mut(a.max(b));
            let (x, y) = (&mut lo[a.min(b)], &mut hi[0]);
            let (src, dst) = if a < b { (x, y) } else { (y, x) };
            transfer(&mut src.out, &mut dst.inn, t, d)
        }
        (Some(a), None) => nics[a].out.reserve(t, d),
        (None, Some(b)) => nics[b].inn.reserve(t, d),
        (None, None) => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_receiver_delays_its_own_messages_and_not_the_senders_next_one() {
        let mut nics = vec![Nic::default(); 3];
        // Host 1's ingress is busy until 1.0 with another transfer.
        nics[1].inn.reserve(0.0, 1.0);
        // Host 0 sends 0.1 s of bytes to host 1: they leave at once but are in only once host 1 is free.
        let to_busy = send(&mut nics, Some(0), Some(1), 0.0, 0.1);
        assert!((to_busy - 1.1).abs() < 1e-12, "{to_busy}");
        // Its next message, to host 2, leaves right after the first one's bytes left.
        let to_free = send(&mut nics, Some(0), Some(2), 0.0, 0.1);
        assert!((to_free - 0.2).abs() < 1e-12, "{to_free}");
    }

    #[test]
    fn two_senders_into_one_receiver_share_its_ingress() {
        let mut nics = vec![Nic::default(); 3];
        let a = send(&mut nics, Some(0), Some(2), 0.0, 0.1);
        let b = send(&mut nics, Some(1), Some(2), 0.0, 0.1);
        assert!(
            (a - 0.1).abs() < 1e-12 && (b - 0.2).abs() < 1e-12,
            "{a} {b}"
        );
        // A slow sender bounds the arrival: bytes are never in before they left.
        let mut nics = vec![Nic::default(); 2];
        nics[0].out.reserve(0.0, 0.5);
        let c = send(&mut nics, Some(0), Some(1), 0.0, 0.1);
        assert!((c - 0.6).abs() < 1e-12, "{c}");
    }
}
