//! The hello/welcome handshake that opens every connection's control channel: the worker sends its `Hello` and
//! waits for the shard's `Welcome`; the shard accepts a `Hello` only at its protocol version and layout hash, for a
//! rank the peer's certificate may claim, and otherwise refuses with a typed `Control::Error` and closes the
//! connection with that code.

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
            reject(&conn, Some(control), &err).await;
            Err(err.into())
        }
    }
}
