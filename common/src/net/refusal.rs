//! Permanent handshake refusals: recognises, in a failed QUIC connection, the TLS alert that ended its handshake
//! (unknown CA, revoked or expired certificate, no certificate, ...), and says which side refused and whose
//! certificate is at fault. Pure: reads a [`quinn::ConnectionError`], does no I/O.
//!
//! Invariant: only a TLS alert is a refusal. A connection refused by the OS, a timeout, a reset or an application
//! close is not one (it may succeed on retry); an alert does not change until a certificate, key or CA file does.

use std::fmt;

/// QUIC carries a TLS alert `A` as the transport error code `0x100 + A` (RFC 9001 §4.8).
const CRYPTO_ERROR_BASE: u64 = 0x100;
/// `internal_error`: a local failure of the TLS stack, not a verdict on the peer; retried like a transient error.
const INTERNAL_ERROR: u8 = 80;

/// Which end of the connection refused the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedBy {
    /// This endpoint refused the peer (its certificate did not verify here).
    Us,
    /// The peer refused this endpoint (our certificate did not verify there).
    Peer,
}

/// A TLS handshake that ended with an alert: retrying with the same files cannot succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeRefusal {
    /// Who refused.
    pub by: RefusedBy,
    /// The TLS alert description (RFC 8446 §6).
    pub alert: u8,
    /// The TLS stack's own words (e.g. `invalid peer certificate: UnknownIssuer`), possibly empty.
    pub detail: String,
}

impl HandshakeRefusal {
    /// The refusal in `e`, when `e` ended a handshake with a TLS alert (sent by us or by the peer).
    pub fn classify(e: &quinn::ConnectionError) -> Option<HandshakeRefusal> {
        let (by, code, detail) = match e {
            quinn::ConnectionError::TransportError(t) => {
                (RefusedBy::Us, u64::from(t.code), t.reason.clone())
            }
            quinn::ConnectionError::ConnectionClosed(c) => (
                RefusedBy::Peer,
                u64::from(c.error_code),
                peer_text(&c.reason),
            ),
            _ => return None,
        };
        let alert = u8::try_from(code.checked_sub(CRYPTO_ERROR_BASE)?).ok()?;
        (alert != INTERNAL_ERROR).then_some(HandshakeRefusal { by, alert, detail })
    }

    /// The alert's name as the TLS specification spells it (`unknown_ca`), or `alert N` for one without a name here.
    pub fn alert_name(&self) -> String {
        let name = match self.alert {
            0 => "close_notify",
            10 => "unexpected_message",
            20 => "bad_record_mac",
            40 => "handshake_failure",
            42 => "bad_certificate",
            43 => "unsupported_certificate",
            44 => "certificate_revoked",
            45 => "certificate_expired",
            46 => "certificate_unknown",
            47 => "illegal_parameter",
            48 => "unknown_ca",
            49 => "access_denied",
            50 => "decode_error",
            51 => "decrypt_error",
            70 => "protocol_version",
            71 => "insufficient_security",
            86 => "inappropriate_fallback",
            109 => "missing_extension",
            110 => "unsupported_extension",
            112 => "unrecognized_name",
            116 => "certificate_required",
            120 => "no_application_protocol",
            n => return format!("alert {n}"),
        };
        name.to_string()
    }

    /// What the alert means for a certificate, in a few words.
    fn meaning(&self) -> &'static str {
        match self.alert {
            // A CA of another name is unknown; one of the same name (another cluster's keygen) fails the signature.
            48 | 51 => "not signed by the trusted CA",
            44 => "revoked",
            45 => "expired or not yet valid",
            42 | 43 | 46 => "not acceptable",
            116 => "missing",
            120 => "offered for another protocol (ALPN)",
            70 => "from an unsupported TLS version",
            _ => "refused",
        }
    }
}

/// The peer's close reason as one line fit for a log: at most [`MAX_PEER_TEXT`] characters, control characters
/// (a forged log line's newline among them) replaced.
fn peer_text(reason: &[u8]) -> String {
    String::from_utf8_lossy(reason)
        .chars()
        .take(MAX_PEER_TEXT)
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect()
}

/// Longest close reason of a peer's that is kept.
const MAX_PEER_TEXT: usize = 200;

impl fmt::Display for HandshakeRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whose = match self.by {
            RefusedBy::Us => "the peer's certificate was refused here",
            RefusedBy::Peer => "the peer refused our certificate",
        };
        write!(f, "{whose}: {} ({}", self.meaning(), self.alert_name())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::{HandshakeRefusal, RefusedBy};
    use crate::net::NetError;
    use crate::protocol::ErrorCode;

    fn ours(code: quinn::TransportErrorCode) -> quinn::ConnectionError {
        quinn::ConnectionError::TransportError(quinn_proto::TransportError {
            code,
            frame: None,
            reason: "invalid peer certificate: UnknownIssuer".into(),
        })
    }

    fn theirs(code: quinn::TransportErrorCode) -> quinn::ConnectionError {
        quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: code,
            frame_type: None,
            reason: bytes::Bytes::from_static(b"invalid peer certificate: Revoked"),
        })
    }

    #[test]
    fn a_tls_alert_is_a_permanent_refusal_and_says_who_refused() {
        let crypto = quinn::TransportErrorCode::crypto;
        let unknown = HandshakeRefusal::classify(&ours(crypto(48))).unwrap();
        assert_eq!((unknown.by, unknown.alert), (RefusedBy::Us, 48));
        assert_eq!(unknown.alert_name(), "unknown_ca");
        assert!(unknown.to_string().contains("not signed by the trusted CA"));
        let revoked = HandshakeRefusal::classify(&theirs(crypto(44))).unwrap();
        assert_eq!((revoked.by, revoked.alert), (RefusedBy::Peer, 44));
        assert_eq!(revoked.detail, "invalid peer certificate: Revoked");
        assert!(revoked
            .to_string()
            .contains("the peer refused our certificate: revoked"));
        assert!(NetError::from(theirs(crypto(45))).is_permanent());
        // The peer's words reach a log: one bounded line, whatever it sent.
        let forged = quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: crypto(42),
            frame_type: None,
            reason: bytes::Bytes::from(format!("bad\nWARN forged{}", "x".repeat(1000))),
        });
        let detail = HandshakeRefusal::classify(&forged).unwrap().detail;
        assert!(
            !detail.contains('\n') && detail.chars().count() == 200,
            "{detail}"
        );
        assert!(matches!(
            NetError::from(ours(crypto(116))),
            NetError::Refused(_)
        ));
    }

    #[test]
    fn transient_failures_are_no_refusal_and_are_retried() {
        let transient = [
            quinn::ConnectionError::TimedOut,
            quinn::ConnectionError::Reset,
            quinn::ConnectionError::LocallyClosed,
            // A local TLS failure (internal_error) and a transport error other than an alert.
            ours(quinn::TransportErrorCode::crypto(80)),
            ours(quinn::TransportErrorCode::PROTOCOL_VIOLATION),
            theirs(quinn::TransportErrorCode::CONNECTION_REFUSED),
        ];
        for e in transient {
            assert_eq!(HandshakeRefusal::classify(&e), None, "{e}");
            let net = NetError::from(e);
            assert!(matches!(net, NetError::Connection(_)), "{net}");
            assert!(!net.is_permanent(), "{net}");
        }
        assert!(!NetError::Resolve("shard-0:7000".into()).is_permanent());
        assert!(NetError::from(quinn::ConnectionError::VersionMismatch).is_permanent());
        // A shard whose connection budget is full says so with `Overloaded`: try again later. Other codes are final.
        let closed = |code: ErrorCode| {
            NetError::from(quinn::ConnectionError::ApplicationClosed(
                quinn::ApplicationClose {
                    error_code: code.close_code(),
                    reason: bytes::Bytes::from_static(b"closed"),
                },
            ))
        };
        assert!(!closed(ErrorCode::Overloaded).is_permanent());
        assert!(closed(ErrorCode::Unauthorized).is_permanent());
        // A connection the peer dropped (quinn closes it with code 0) or ended in order: ask again.
        let dropped = NetError::from(quinn::ConnectionError::ApplicationClosed(
            quinn::ApplicationClose {
                error_code: 0u32.into(),
                reason: bytes::Bytes::new(),
            },
        ));
        assert!(!dropped.is_permanent(), "{dropped}");
    }
}
