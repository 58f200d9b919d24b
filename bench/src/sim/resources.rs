//! The simulator's resources: FIFO servers (a CPU, one direction of a NIC), a transfer that holds two of them at
//! once (cut-through), and a pool of cores shared by every CPU job. Reservations are greedy and never preempted: a
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

/// Holds two FIFOs (egress and ingress) for one message: it starts when both are free.
pub(super) fn transfer(out: &mut Fifo, inn: &mut Fifo, t: f64, d: f64) -> f64 {
    let start = t.max(out.free).max(inn.free);
    out.free = start + d;
    inn.free = start + d;
    out.busy += d;
    inn.busy += d;
    start + d
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
