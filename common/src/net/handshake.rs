//! The hello/welcome handshake that opens every connection's control channel: the worker sends its `Hello` and
//! waits for the shard's `Welcome`; the shard accepts a `Hello` only at its protocol version and layout hash, for a
//! rank the peer's certificate may claim, and otherwise refuses with a typed `Control::Error` and closes the
//! connection with that code. A refusal tells the peer what it sent, never what the shard expected: a layout
//! mismatch is refused without the shard's layout hash (which only the shard's log records).

use super::streams::{reject, ControlChannel};
use super::{NetError, PeerIdentity};
use crate::protocol::control::{Hello, Welcome};
use crate::protocol::{Control, ProtocolError};

/// Worker side: sends `hello` and waits for the `Welcome` (a `Control::Error` answer becomes
/// [`ProtocolError::Remote`]).
pub async fn client_handshake(
    control: &mut ControlChannel,
    hello: Hello,
) -> Result<Welcome, NetError> {
    control.send(&hello.into()).await?;
    match control.recv().await? {
        Control::Welcome(welcome) => Ok(welcome),
        Control::Error { code, message } => Err(ProtocolError::Remote { code, message }.into()),
        other => Err(ProtocolError::UnexpectedMessage(format!(
            "{} instead of Welcome",
            other.name()
        ))
        .into()),
    }
}

/// Server side: reads the first message, which must be a `Hello` at our protocol version and layout hash for a
/// rank `identity` may claim. On any violation, sends `Control::Error`, closes the connection with its code and
/// returns the error.
pub async fn server_accept_hello(
    control: &mut ControlChannel,
    expected_layout_hash: u64,
    identity: PeerIdentity,
) -> Result<Hello, NetError> {
    let checked = match control.recv().await {
        Ok(Control::Hello(hello)) => hello
            .check(
                expected_layout_hash,
                |r| identity.allows_rank(r),
                &identity.to_string(),
            )
            .map(|()| hello),
        Ok(other) => Err(ProtocolError::UnexpectedMessage(format!(
            "{} before Hello",
            other.name()
        ))),
        Err(NetError::Protocol(p)) => Err(p),
        Err(other) => return Err(other),
    };
    match checked {
        Ok(hello) => Ok(hello),
        Err(err) => {
            let conn = control.connection().clone();
            let told = for_the_peer(&err);
            if told != err {
                tracing::warn!(peer = %conn.remote_address(), "hello refused: {err}");
            }
            reject(&conn, Some(control), &told).await;
            Err(err.into())
        }
    }
}

/// The refusal a peer is sent for `err`: the same code, without what the shard expected where that is the shard's
/// own configuration (its layout hash).
fn for_the_peer(err: &ProtocolError) -> ProtocolError {
    match err {
        ProtocolError::BadLayoutHash { got, .. } => ProtocolError::Rejected {
            code: err.code(),
            message: format!("layout hash {got:#018x} does not match this shard's model"),
        },
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_refusal_keeps_its_code_but_not_the_expected_hash() {
        let err = ProtocolError::BadLayoutHash {
            expected: 0x1234_5678_9abc_def0,
            got: 0,
        };
        let told = for_the_peer(&err);
        assert_eq!(told.code(), err.code());
        let text = told.to_string();
        assert!(!text.contains("123456789abcdef0"), "{text}");
        assert!(text.contains("0x0000000000000000"), "{text}");
        let other = ProtocolError::UnexpectedMessage("Pull before Hello".into());
        assert_eq!(for_the_peer(&other), other);
    }
}
