//! Frames over a byte stream with buffers that cost nothing while the
//! connection is idle: what the node's client connections and the SDK use
//! in place of `tokio_util::codec::Framed`, whose read and write buffers
//! stay at 8 KiB each for the life of a connection (16 KiB of every idle
//! connection, most of what one cost).
//!
//! [`FrameReader`] holds no buffer while nothing is buffered: it waits for
//! bytes with a transient buffer on the stack and keeps a heap buffer only
//! while a frame is in progress (grown to the frame's size, as the codec
//! asks) or while bytes keep coming; when the stream has nothing more to
//! read and the buffer is empty, the buffer is given back. [`FrameWriter`]
//! encodes the frames of one batch into a buffer, writes it and gives the
//! buffer back after every flush.
//!
//! Both are cancel safe in the sense `tokio::select!` needs: a
//! [`FrameReader::next`] dropped before it completes loses no bytes (they
//! stay in the reader's buffer).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio_util::codec::Decoder as _;

use crate::{CodecError, Frame, FrameCodec};

/// The stack buffer an idle reader reads into: one read of a busy stream
/// takes up to this much.
const IDLE_READ_BYTES: usize = 8 * 1024;
/// What a reader with a frame in progress reserves at least before a read.
const BUSY_READ_BYTES: usize = 4 * 1024;

/// Reads frames from `R` (see the module docs for its buffering).
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    codec: FrameCodec,
    buffer: BytesMut,
    eof: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Reads frames of at most `codec`'s size from `inner`.
    pub fn new(inner: R, codec: FrameCodec) -> Self {
        FrameReader {
            inner,
            codec,
            buffer: BytesMut::new(),
            eof: false,
        }
    }

    /// The next frame; `None` at a clean end of the stream (between
    /// frames), an error for bad bytes, a stream that ends inside a frame,
    /// or a failed read.
    pub async fn next(&mut self) -> Option<Result<Frame, CodecError>> {
        poll_fn(|cx| self.poll_next_frame(cx)).await
    }

    /// The poll form of [`FrameReader::next`].
    pub fn poll_next_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame, CodecError>>> {
        loop {
            match self.codec.decode(&mut self.buffer) {
                Ok(Some(frame)) => return Poll::Ready(Some(Ok(frame))),
                Ok(None) => {}
                Err(error) => return Poll::Ready(Some(Err(error))),
            }
            if self.eof {
                return Poll::Ready(self.codec.decode_eof(&mut self.buffer).transpose());
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) => self.eof = true,
                Ok(_) => {}
                Err(error) => return Poll::Ready(Some(Err(CodecError::Io(error)))),
            }
        }
    }

    /// Bytes buffered and not yet decoded (for tests and diagnostics).
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// The heap the read buffer holds now, in bytes (0 while idle).
    pub fn buffer_capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// Reads more bytes into the buffer: `Ok(0)` at the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buffer.is_empty() {
            let mut chunk = [0u8; IDLE_READ_BYTES];
            let mut read = ReadBuf::new(&mut chunk);
            return match Pin::new(&mut self.inner).poll_read(cx, &mut read) {
                Poll::Pending => {
                    // Nothing to read and nothing buffered: idle, so the
                    // buffer goes back to the allocator.
                    self.buffer = BytesMut::new();
                    Poll::Pending
                }
                Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
                Poll::Ready(Ok(())) => {
                    self.buffer.extend_from_slice(read.filled());
                    Poll::Ready(Ok(read.filled().len()))
                }
            };
        }
        // A frame in progress: straight into the buffer, which the codec
        // has grown to the frame's size when it knows it.
        if self.buffer.capacity() - self.buffer.len() < BUSY_READ_BYTES {
            self.buffer.reserve(BUSY_READ_BYTES);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.inner), cx, &mut self.buffer)
    }

    /// The stream, for what is not reading frames.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }
}

/// Writes frames to `W` (see the module docs for its buffering).
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    codec: FrameCodec,
    buffer: BytesMut,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Writes frames of at most `codec`'s size to `inner`.
    pub fn new(inner: W, codec: FrameCodec) -> Self {
        FrameWriter {
            inner,
            codec,
            buffer: BytesMut::new(),
        }
    }

    /// Encodes `frame` into the batch [`FrameWriter::flush`] writes; a frame
    /// above the size limit is refused and nothing of it is queued.
    pub fn queue(&mut self, frame: &impl prost::Message) -> Result<(), CodecError> {
        self.codec.encode_frame(frame, &mut self.buffer)
    }

    /// Writes the queued frames and flushes the stream; the buffer is
    /// given back either way.
    pub async fn flush(&mut self) -> io::Result<()> {
        let written = self.inner.write_all(&self.buffer).await;
        self.buffer = BytesMut::new();
        written?;
        self.inner.flush().await
    }

    /// Queues `frame` and flushes.
    pub async fn send(&mut self, frame: &Frame) -> Result<(), CodecError> {
        self.queue(frame)?;
        self.flush().await.map_err(CodecError::Io)
    }

    /// Flushes what is queued and shuts the stream's writing side down.
    pub async fn close(&mut self) -> io::Result<()> {
        self.flush().await?;
        self.inner.shutdown().await
    }

    /// Bytes queued and not yet written.
    pub fn queued(&self) -> usize {
        self.buffer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kind;
    use crate::v1;

    fn ping(nonce: u64) -> Frame {
        Frame::of(Kind::Ping(v1::Ping { nonce }))
    }

    #[tokio::test]
    async fn frames_written_are_read_back_in_order_and_the_idle_reader_holds_no_buffer() {
        let (a, b) = tokio::io::duplex(64);
        let mut writer = FrameWriter::new(a, FrameCodec::new(1 << 20));
        let mut reader = FrameReader::new(b, FrameCodec::new(1 << 20));
        let big = Frame::of(Kind::Error(v1::Error {
            code: 1,
            message: "x".repeat(100_000),
        }));
        // Awaited below.
        #[allow(clippy::disallowed_methods)]
        let sending = tokio::spawn(async move {
            for n in 0..100 {
                writer.queue(&ping(n)).unwrap();
            }
            writer.queue(&big).unwrap();
            writer.flush().await.unwrap();
            assert_eq!(writer.queued(), 0);
            writer.send(&ping(100)).await.unwrap();
            writer
        });
        for n in 0..100 {
            match reader.next().await.unwrap().unwrap().kind {
                Some(Kind::Ping(p)) => assert_eq!(p.nonce, n),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            reader.next().await.unwrap().unwrap().kind,
            Some(Kind::Error(e)) if e.message.len() == 100_000
        ));
        assert!(matches!(
            reader.next().await.unwrap().unwrap().kind,
            Some(Kind::Ping(p)) if p.nonce == 100
        ));
        let mut writer = sending.await.unwrap();
        // Waiting with nothing to read gives the buffer back.
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.next()).await;
        assert!(waiting.is_err());
        assert_eq!(reader.buffer_capacity(), 0);
        // A clean end between frames is None; inside a frame, an error.
        writer.close().await.unwrap();
        assert!(reader.next().await.is_none());
    }

    #[tokio::test]
    async fn a_stream_cut_inside_a_frame_is_a_truncation_error() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut reader = FrameReader::new(b, FrameCodec::new(1024));
        a.write_all(&[0, 0, 0, 10, 1, 2]).await.unwrap();
        drop(a);
        match reader.next().await {
            Some(Err(CodecError::Truncated { received, expected })) => {
                assert_eq!((received, expected), (6, 14));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_frame_above_the_limit_is_refused_on_both_sides() {
        let (a, b) = tokio::io::duplex(1024);
        let mut writer = FrameWriter::new(a, FrameCodec::new(16));
        let big = Frame::of(Kind::Error(v1::Error {
            code: 1,
            message: "x".repeat(100),
        }));
        assert!(matches!(
            writer.queue(&big),
            Err(CodecError::TooLarge { .. })
        ));
        assert_eq!(writer.queued(), 0);
        let mut raw = FrameWriter::new(a_inner(writer), FrameCodec::new(1 << 20));
        raw.send(&big).await.unwrap();
        let mut reader = FrameReader::new(b, FrameCodec::new(16));
        assert!(matches!(
            reader.next().await,
            Some(Err(CodecError::TooLarge { .. }))
        ));
    }

    fn a_inner<W>(writer: FrameWriter<W>) -> W {
        writer.inner
    }
}
