//! The streams of one connection, shared by servers and workers: the control channel (one long-lived bidirectional
//! stream of framed bincode messages), one unidirectional stream per bulk frame, and closing a connection with a
//! protocol error code. Bytes that violate the protocol become [`NetError::Protocol`], never a panic.

use rkyv::util::AlignedVec;

use super::NetError;
use crate::protocol::control::{decode_control, encode_control};
use crate::protocol::framing::{expect_end, read_frame, FrameHeader};
use crate::protocol::{Control, ErrorCode, FrameKind, FrameLimits, ProtocolError, HEADER_LEN};

/// Longest close reason we send (the message also travels in `Control::Error` when it can).
const MAX_CLOSE_REASON: usize = 256;

fn read_error(e: std::io::Error) -> NetError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<quinn::ReadError>())
    {
        Some(quinn::ReadError::ConnectionLost(lost)) => NetError::from(lost.clone()),
        _ => NetError::Read(e),
    }
}

fn write_error(e: quinn::WriteError) -> NetError {
    match e {
        quinn::WriteError::ConnectionLost(lost) => NetError::from(lost),
        other => NetError::Write(other),
    }
}

fn net(e: crate::protocol::ReadFrameError) -> NetError {
    match e {
        crate::protocol::ReadFrameError::Protocol(p) => NetError::Protocol(p),
        crate::protocol::ReadFrameError::Io(io) => read_error(io),
    }
}

/// The connection's control stream: framed [`Control`] messages in both directions.
#[derive(Debug)]
pub struct ControlChannel {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    buf: AlignedVec,
    limits: FrameLimits,
}

impl ControlChannel {
    /// Opens the control stream (client side; the peer sees it with the first message sent).
    pub async fn open(conn: &quinn::Connection) -> Result<ControlChannel, NetError> {
        let (send, recv) = conn.open_bi().await?;
        Ok(Self::new(conn, send, recv))
    }

    /// Accepts the peer's control stream (server side).
    pub async fn accept(conn: &quinn::Connection) -> Result<ControlChannel, NetError> {
        let (send, recv) = conn.accept_bi().await?;
        Ok(Self::new(conn, send, recv))
    }

    fn new(
        conn: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> ControlChannel {
        // Only the control limit matters on this stream; bulk kinds are refused by kind, not size.
        let limits = FrameLimits::for_shard(0, 0);
        ControlChannel {
            conn: conn.clone(),
            send,
            recv,
            buf: AlignedVec::new(),
            limits,
        }
    }

    /// The connection this channel belongs to.
    pub fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    /// Sends one message.
    pub async fn send(&mut self, msg: &Control) -> Result<(), NetError> {
        let body = encode_control(msg)?;
        let header = FrameHeader::encode(FrameKind::Control, body.len())?;
        let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
        frame.extend_from_slice(&header);
        frame.extend_from_slice(&body);
        self.send.write_all(&frame).await.map_err(write_error)
    }

    /// Receives one message; the peer ending the stream is [`NetError::ControlClosed`].
    pub async fn recv(&mut self) -> Result<Control, NetError> {
        receive(&mut self.recv, &self.limits, &mut self.buf).await
    }
}

impl ControlChannel {
    /// Splits the channel into its sending and receiving halves, so that one task may write (outcomes, refusals,
    /// heartbeats) while another reads.
    pub fn split(self) -> (ControlSender, ControlReceiver) {
        (
            ControlSender { send: self.send },
            ControlReceiver {
                recv: self.recv,
                buf: self.buf,
                limits: self.limits,
            },
        )
    }
}

/// The sending half of a [`ControlChannel`].
#[derive(Debug)]
pub struct ControlSender {
    send: quinn::SendStream,
}

impl ControlSender {
    /// Sends one message.
    pub async fn send(&mut self, msg: &Control) -> Result<(), NetError> {
        let body = encode_control(msg)?;
        let header = FrameHeader::encode(FrameKind::Control, body.len())?;
        self.send.write_all(&header).await.map_err(write_error)?;
        self.send.write_all(&body).await.map_err(write_error)
    }
}

/// The receiving half of a [`ControlChannel`].
#[derive(Debug)]
pub struct ControlReceiver {
    recv: quinn::RecvStream,
    buf: AlignedVec,
    limits: FrameLimits,
}

impl ControlReceiver {
    /// Receives one message; the peer ending the stream is [`NetError::ControlClosed`].
    pub async fn recv(&mut self) -> Result<Control, NetError> {
        receive(&mut self.recv, &self.limits, &mut self.buf).await
    }
}

async fn receive(
    recv: &mut quinn::RecvStream,
    limits: &FrameLimits,
    buf: &mut AlignedVec,
) -> Result<Control, NetError> {
    match read_frame(recv, limits, &[FrameKind::Control], buf)
        .await
        .map_err(net)?
    {
        Some(_) => Ok(decode_control(buf)?),
        None => Err(NetError::ControlClosed),
    }
}

/// Sends one bulk frame on a fresh unidirectional stream (header, body, finish).
pub async fn send_bulk(
    conn: &quinn::Connection,
    kind: FrameKind,
    body: &[u8],
) -> Result<(), NetError> {
    let header = FrameHeader::encode(kind, body.len())?;
    let mut stream = conn.open_uni().await?;
    stream.write_all(&header).await.map_err(write_error)?;
    stream.write_all(body).await.map_err(write_error)?;
    stream.finish()?;
    Ok(())
}

/// Writes one frame of `kind` whose body is `chunks` concatenated on a new unidirectional stream, then finishes
/// it. The chunks are handed to quinn as they are (shared `Bytes`, no copy).
pub async fn send_bulk_chunks(
    conn: &quinn::Connection,
    kind: FrameKind,
    mut chunks: Vec<bytes::Bytes>,
) -> Result<(), NetError> {
    let len: usize = chunks.iter().map(|c| c.len()).sum();
    let header = FrameHeader::encode(kind, len)?;
    chunks.insert(0, bytes::Bytes::copy_from_slice(&header));
    let mut stream = conn.open_uni().await?;
    stream
        .write_all_chunks(&mut chunks)
        .await
        .map_err(write_error)?;
    stream.finish()?;
    Ok(())
}

/// One received bulk frame; `body` is 16-byte aligned for validated rkyv access.
#[derive(Debug)]
pub struct BulkFrame {
    /// The frame kind.
    pub kind: FrameKind,
    /// The frame body.
    pub body: AlignedVec,
}

/// Reads exactly one frame of `kind` from a unidirectional stream, which must then end.
pub async fn recv_bulk(
    stream: quinn::RecvStream,
    limits: &FrameLimits,
    kind: FrameKind,
) -> Result<BulkFrame, NetError> {
    recv_bulk_any(stream, limits, &[kind]).await
}

/// Reads exactly one frame of one of `kinds` from a unidirectional stream, which must then end.
pub async fn recv_bulk_any(
    mut stream: quinn::RecvStream,
    limits: &FrameLimits,
    kinds: &[FrameKind],
) -> Result<BulkFrame, NetError> {
    let mut body = AlignedVec::new();
    match read_frame(&mut stream, limits, kinds, &mut body)
        .await
        .map_err(net)?
    {
        Some(kind) => {
            expect_end(&mut stream).await.map_err(net)?;
            Ok(BulkFrame { kind, body })
        }
        None => Err(ProtocolError::Truncated {
            expected: HEADER_LEN as u64,
            got: 0,
        }
        .into()),
    }
}

/// Closes `conn` with `code` as the application close code.
pub fn close_with(conn: &quinn::Connection, code: ErrorCode, reason: &str) {
    let mut cut = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    conn.close(code.close_code(), &reason.as_bytes()[..cut]);
}

/// Tells the peer why (a best-effort `Control::Error` when a control channel is given) and closes the
/// connection with the error's code.
pub async fn reject(
    conn: &quinn::Connection,
    control: Option<&mut ControlChannel>,
    err: &ProtocolError,
) {
    tracing::warn!(peer = %conn.remote_address(), code = %err.code(), "closing connection: {err}");
    if let Some(control) = control {
        // Best effort: the close below carries the same code and message, so a failed send loses nothing.
        let _ = control.send(&Control::error(err)).await;
    }
    close_with(conn, err.code(), &err.to_string());
}
