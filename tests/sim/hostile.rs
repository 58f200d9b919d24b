//! The hostile member: a configured rank ([`HOSTILE`]) whose certificate a compromised or broken node holds. It
//! speaks the real frames to the real shard protocols but follows no protocol: it says hello at absurd clocks, floods
//! zero-gradient pushes and skip markers without pulling, opens a second session and keeps pushing on the superseded
//! one, says goodbye and comes back, or falls silent. A rank beyond the configured workers tries to join as well.
//!
//! What it must never achieve is checked where the shards take rounds and hellos (see `net.rs` and `mod.rs`): no
//! round applied more than `s + 1` ahead of the minimum clock, nothing applied from a superseded connection, the join
//! value never at a departed member's clock, a rank beyond the configured count never a member; the honest workers
//! still finish with the read guarantee and nothing applied twice. Its moves are drawn from their own generator, so
//! the schedules without it are the same as before it existed.

use std::collections::BTreeMap;

use tether::common::protocol::{encode_push, PushFrame};
use tether::server::protocol::{Handled, Input};
use tether::server::shard::MAX_CLOCK;

use super::net::{Conn, Lane, Msg, Payload};
use super::{Sim, SHARDS, WORKERS};

/// The hostile member's rank: one past the honest workers, and configured (the shards take `WORKERS + 1` ranks).
pub const HOSTILE: usize = WORKERS;

/// A rank beyond the configured count: every hello of it must be refused.
pub const BEYOND: u32 = WORKERS as u32 + 1;

/// One move of the hostile member.
#[derive(Debug, Clone, Copy)]
pub enum Move {
    /// A hello on a new connection at this clock claim.
    Hello {
        /// The shard.
        shard: usize,
        /// The claimed clock.
        claim: u64,
    },
    /// Up to `count` rounds from its clock on its newest connection, all at once, without pulling.
    Flood {
        /// The shard.
        shard: usize,
        /// Rounds sent.
        count: u64,
        /// Skip markers instead of zero gradients.
        skips: bool,
    },
    /// A second session: a new hello, then rounds on the old connection (delivered late, as a dead connection's
    /// last streams are).
    Supersede {
        /// The shard.
        shard: usize,
    },
    /// A goodbye at its clock.
    Goodbye {
        /// The shard.
        shard: usize,
    },
    /// A hello of a rank beyond the configured workers.
    Beyond {
        /// The shard.
        shard: usize,
    },
}

impl Sim {
    /// The hostile member's next move, when the seed's mix has one and its generator draws one now.
    pub(super) fn hostile_turn(&mut self) {
        if !self.faults.hostile || !self.hostile_rng.chance(20) {
            return;
        }
        let shard = self.hostile_rng.below(SHARDS as u64) as usize;
        let m = match self.hostile_rng.below(6) {
            0 | 1 => {
                let claim = match self.hostile_rng.below(5) {
                    0 => 1 << 40,
                    1 => MAX_CLOCK,
                    2 => MAX_CLOCK + 1,
                    3 => u64::MAX,
                    _ => self.hostile_rng.below(40),
                };
                Move::Hello { shard, claim }
            }
            2 => Move::Flood {
                shard,
                count: 1 + self.hostile_rng.below(16),
                skips: self.hostile_rng.chance(500),
            },
            3 => Move::Supersede { shard },
            4 => Move::Goodbye { shard },
            _ => Move::Beyond { shard },
        };
        if let Err(e) = self.hostile(m) {
            self.failure.get_or_insert(e);
        }
    }

    /// Carries out one hostile move (scripted scenarios call it directly).
    pub fn hostile(&mut self, m: Move) -> Result<(), String> {
        self.note(format!("hostile: {m:?}"));
        match m {
            Move::Hello { shard, claim } => {
                self.hostile_hello(shard, claim)?;
            }
            Move::Flood {
                shard,
                count,
                skips,
            } => {
                let Some(conn) = self.hostile_conn(shard) else {
                    return Ok(());
                };
                let from = self.shards[shard]
                    .proto
                    .as_ref()
                    .and_then(|p| p.core().clocks().clock_of(HOSTILE as u32))
                    .unwrap_or(0);
                for clock in from..from.saturating_add(count) {
                    let bytes = self.hostile_frame(shard, clock, skips)?;
                    self.send(Msg {
                        conn,
                        worker: HOSTILE,
                        shard,
                        lane: Lane::PushUp,
                        payload: Payload::Push(bytes),
                    });
                }
            }
            Move::Supersede { shard } => {
                let Some(old) = self.hostile_conn(shard) else {
                    return Ok(());
                };
                let from = self.shards[shard]
                    .proto
                    .as_ref()
                    .and_then(|p| p.core().clocks().clock_of(HOSTILE as u32))
                    .unwrap_or(0);
                if self.hostile_hello(shard, from)?.is_none() {
                    return Ok(());
                }
                // The old connection's last streams: each must be refused (the checker in `take_push` fails the
                // schedule if one is applied).
                for clock in from..from + 3 {
                    let bytes = self.hostile_frame(shard, clock, clock % 2 == 0)?;
                    self.take_push(shard, old, HOSTILE, bytes)?;
                }
            }
            Move::Goodbye { shard } => {
                let Some(conn) = self.hostile_conn(shard) else {
                    return Ok(());
                };
                let now = self.now;
                if let Some(p) = self.shards[shard].proto.as_ref() {
                    let clock = p.core().clocks().clock_of(HOSTILE as u32).unwrap_or(0);
                    self.feed(
                        shard,
                        Input::Goodbye {
                            conn,
                            worker: HOSTILE as u32,
                            clock,
                            now_ms: now,
                        },
                    );
                }
                self.drain_shard(shard)?;
            }
            Move::Beyond { shard } => {
                let conn = self.next_conn;
                self.next_conn += 1;
                let now = self.now;
                let hello = Input::Hello {
                    conn,
                    worker: BEYOND,
                    clock: 0,
                    now_ms: now,
                };
                if let Some(Handled::Welcome(welcomed)) = self.feed(shard, hello) {
                    let Some(p) = self.shards[shard].proto.as_mut() else {
                        return Ok(());
                    };
                    if let Ok(w) = welcomed {
                        return Err(format!(
                            "shard {shard} welcomed rank {BEYOND} beyond the configured workers at clock {}",
                            w.clock
                        ));
                    }
                    if p.core().clocks().is_live(BEYOND) || p.core().clocks().is_evicted(BEYOND) {
                        return Err(format!(
                            "a refused rank {BEYOND} left a row in shard {shard}'s table"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// A hello of the hostile member on a new connection; the connection, when the shard is up and took it.
    fn hostile_hello(&mut self, shard: usize, claim: u64) -> Result<Option<u64>, String> {
        let conn = self.next_conn;
        self.next_conn += 1;
        let now = self.now;
        let hello = Input::Hello {
            conn,
            worker: HOSTILE as u32,
            clock: claim,
            now_ms: now,
        };
        let Some(Handled::Welcome(hello)) = self.feed(shard, hello) else {
            return Ok(None);
        };
        let welcome = match hello {
            Ok(w) => w,
            Err(e) => {
                if claim <= MAX_CLOCK {
                    return Err(format!(
                        "shard {shard} refused the hostile hello at {claim}: {e}"
                    ));
                }
                return Ok(None);
            }
        };
        self.observe_quorum(shard);
        self.note(format!(
            "hostile joined s{shard} at {} (claimed {claim}, conn {conn})",
            welcome.clock
        ));
        self.shards[shard].last_heard.insert(HOSTILE, now);
        self.shards[shard].newest_conn.insert(HOSTILE, conn);
        self.conns.insert(
            conn,
            Conn {
                worker: HOSTILE,
                shard,
                alive: true,
                stalled_until: 0,
                lane_tail: BTreeMap::new(),
            },
        );
        self.drain_shard(shard)?;
        Ok(Some(conn))
    }

    /// The hostile member's newest live connection to `shard`.
    fn hostile_conn(&self, shard: usize) -> Option<u64> {
        let conn = *self.shards[shard].newest_conn.get(&HOSTILE)?;
        self.conns.get(&conn).filter(|c| c.alive).map(|_| conn)
    }

    /// A zero-gradient push (or a skip marker) of the hostile member for `shard` at `clock`.
    fn hostile_frame(
        &mut self,
        shard: usize,
        clock: u64,
        skip: bool,
    ) -> Result<bytes::Bytes, String> {
        let (start, end) = self.ranges(shard);
        let mut payload = Vec::new();
        if !skip {
            self.encoder
                .encode(&vec![0.0f32; end - start], 0, &mut payload)
                .map_err(|e| e.to_string())?;
        }
        let frame = PushFrame {
            worker: HOSTILE as u32,
            clock,
            shard: shard as u32,
            range_start: start as u64,
            range_end: end as u64,
            read_version: 0,
            loss: 0.0,
            skip,
            payload,
        };
        let bytes = encode_push(&frame).map_err(|e| e.to_string())?;
        Ok(bytes::Bytes::from_owner(bytes))
    }
}
