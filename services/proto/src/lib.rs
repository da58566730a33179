//! Protobuf messages and gRPC stubs for `wavefront.v1` (the public API) and
//! `wavefront.worker.v1` (router to worker), generated from `proto/` at build
//! time. The descriptor set feeds server reflection.

#![allow(clippy::all, clippy::pedantic)]

pub mod auth;
pub mod codec;

/// Errors of this crate: configuration it refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// A credential (`--api-key`, `--worker-token`) that cannot travel in a header.
    #[error("{0}")]
    Secret(&'static str),
}

pub mod v1 {
    tonic::include_proto!("wavefront.v1");
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("wavefront.worker.v1");
    }
}

/// Encoded `FileDescriptorSet` of every proto file, for tonic-reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("wavefront_descriptor");

/// Request size limits of the servers.
pub mod limits {
    /// Default largest request message a server decodes, in bytes.
    pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;

    /// gRPC status codes (the wire values) this module reads and writes.
    const OUT_OF_RANGE: &str = "11";
    const RESOURCE_EXHAUSTED: &str = "8";

    /// Longest status message a server sends, in bytes (before percent-encoding): messages
    /// that quote a client's input (an unknown model's name, a misspelled option) are clipped
    /// to it, so that an oversized input cannot push the trailers past the client's metadata
    /// limit and turn a clear refusal into a transport error.
    pub const MAX_STATUS_MESSAGE_BYTES: usize = 1024;

    /// The refusal of a chat of `messages` messages, more than a worker's `max` (its
    /// `--max-chat-messages`): the same words from the worker and from the router that checks
    /// the worker's reported limit before forwarding.
    pub fn too_many_chat_messages(messages: usize, max: usize) -> String {
        format!(
            "the chat has {messages} messages, more than the {max} allowed (--max-chat-messages)"
        )
    }

    /// The refusal of a chat of `messages` messages whose template (and contents) make at
    /// least `at_least` tokens, more than the model's `max_context`: from the worker, and from
    /// the router that checks the template's reported tokens before forwarding.
    pub fn chat_too_long(messages: usize, at_least: usize, max_context: usize) -> String {
        format!(
            "the conversation's {messages} messages make at least {at_least} tokens through the \
             chat template, more than the {max_context} this model accepts (prompt plus \
             max_new_tokens); send fewer or shorter messages"
        )
    }

    /// `message` clipped to [`MAX_STATUS_MESSAGE_BYTES`] at a character boundary, saying how
    /// long it was.
    pub fn clip_message(message: &str) -> std::borrow::Cow<'_, str> {
        if message.len() <= MAX_STATUS_MESSAGE_BYTES {
            return message.into();
        }
        let mut end = MAX_STATUS_MESSAGE_BYTES - 64;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        format!(
            "{}... (clipped; {} bytes in all)",
            &message[..end],
            message.len()
        )
        .into()
    }

    /// `headers` (a response's, or its trailers) tidied for the client: the transport's
    /// refusal of an oversized message becomes RESOURCE_EXHAUSTED, and a long message is
    /// clipped.
    fn remap(headers: &mut http::HeaderMap) {
        resource_exhausted(headers);
        clip(headers);
    }

    /// Clips a `grpc-message` longer than [`MAX_STATUS_MESSAGE_BYTES`].
    fn clip(headers: &mut http::HeaderMap) {
        let Some(v) = headers.get("grpc-message") else {
            return;
        };
        if v.len() <= MAX_STATUS_MESSAGE_BYTES {
            return;
        }
        let text = percent_decode(v.to_str().unwrap_or_default());
        if let Ok(v) = http::HeaderValue::from_str(&percent_encode(&clip_message(&text))) {
            headers.insert("grpc-message", v);
        }
    }

    /// `m` percent-encoded as gRPC encodes `grpc-message`: bytes outside printable ASCII, and
    /// `%`.
    fn percent_encode(m: &str) -> String {
        let mut out = String::with_capacity(m.len());
        for &b in m.as_bytes() {
            if (0x20..=0x7e).contains(&b) && b != b'%' {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }

    /// Whether `headers` carry the transport's refusal of an oversized message; if so they
    /// are rewritten to RESOURCE_EXHAUSTED with a message naming the limit and how to change it.
    fn resource_exhausted(headers: &mut http::HeaderMap) {
        if headers.get("grpc-status").is_none_or(|v| v != OUT_OF_RANGE) {
            return;
        }
        let detail = headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .map(percent_decode)
            .unwrap_or_default();
        if !detail.contains("message length too large") {
            return;
        }
        let message = percent_encode(&format!(
            "request message too large ({detail}); send a smaller request, or raise the \
             server's --max-message-bytes"
        ));
        headers.insert(
            "grpc-status",
            http::HeaderValue::from_static(RESOURCE_EXHAUSTED),
        );
        if let Ok(v) = http::HeaderValue::from_str(&message) {
            headers.insert("grpc-message", v);
        }
    }

    /// The text of a percent-encoded `grpc-message`.
    fn percent_decode(m: &str) -> String {
        let b = m.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            match (
                b[i],
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            ) {
                (b'%', Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                (c, _, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Maps a server's response: the transport refuses a request message over the decoding
    /// limit with OUT_OF_RANGE, which is not among the codes the API documents; it becomes
    /// RESOURCE_EXHAUSTED with a message naming the limit (in the headers of a trailers-only
    /// response, or in the trailers). A status message over [`MAX_STATUS_MESSAGE_BYTES`] is
    /// clipped. Every other response passes unchanged.
    pub fn oversize_as_resource_exhausted(
        mut resp: http::Response<tonic::body::Body>,
    ) -> http::Response<tonic::body::Body> {
        remap(resp.headers_mut());
        resp.map(|b| tonic::body::Body::new(Remapped(b)))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn only_the_oversize_refusal_becomes_resource_exhausted() {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-status", http::HeaderValue::from_static("11"));
            h.insert(
                "grpc-message",
                http::HeaderValue::from_static(
                    "Error,%20decoded%20message%20length%20too%20large:%20found%209%20bytes",
                ),
            );
            remap(&mut h);
            assert_eq!(h["grpc-status"], "8");
            let m = percent_decode(h["grpc-message"].to_str().unwrap());
            assert!(
                m.contains("found 9 bytes") && m.contains("--max-message-bytes"),
                "{m}"
            );
            // Another OUT_OF_RANGE, or another code, passes as it is.
            let mut other = http::HeaderMap::new();
            other.insert("grpc-status", http::HeaderValue::from_static("11"));
            other.insert(
                "grpc-message",
                http::HeaderValue::from_static("index%20past%20end"),
            );
            remap(&mut other);
            assert_eq!(other["grpc-status"], "11");
        }

        #[test]
        fn long_status_messages_are_clipped_and_short_ones_kept() {
            let name = "é".repeat(20_000);
            let message = format!("model \"{name}\" is not served; served models: a, b");
            let mut h = http::HeaderMap::new();
            h.insert("grpc-status", http::HeaderValue::from_static("5"));
            h.insert(
                "grpc-message",
                http::HeaderValue::from_str(&percent_encode(&message)).unwrap(),
            );
            remap(&mut h);
            assert_eq!(h["grpc-status"], "5");
            let m = percent_decode(h["grpc-message"].to_str().unwrap());
            assert!(m.len() <= MAX_STATUS_MESSAGE_BYTES, "{} bytes", m.len());
            assert!(m.starts_with("model \"éé"), "{m}");
            assert!(
                m.ends_with(&format!("; {} bytes in all)", message.len())),
                "{m}"
            );
            let short = "model \"x\" is not served";
            let mut h = http::HeaderMap::new();
            h.insert(
                "grpc-message",
                http::HeaderValue::from_str(&percent_encode(short)).unwrap(),
            );
            remap(&mut h);
            assert_eq!(percent_decode(h["grpc-message"].to_str().unwrap()), short);
        }
    }

    /// A response body whose trailers go through [`remap`].
    struct Remapped(tonic::body::Body);

    impl http_body::Body for Remapped {
        type Data = tonic::codegen::Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            let inner = std::pin::Pin::new(&mut self.get_mut().0);
            inner.poll_frame(cx).map(|f| {
                f.map(|r| {
                    r.map(|frame| match frame.into_trailers() {
                        Ok(mut trailers) => {
                            remap(&mut trailers);
                            http_body::Frame::trailers(trailers)
                        }
                        Err(frame) => frame,
                    })
                })
            })
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_end_stream()
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.0.size_hint()
        }
    }
}

/// The standard `grpc-timeout` header (deadline propagation).
pub mod timeout {
    use std::time::{Duration, Instant};

    /// Parses the wire format: up to 8 digits and a unit (H M S m u n).
    pub fn parse(s: &str) -> Option<Duration> {
        if s.len() < 2 || s.len() > 9 {
            return None;
        }
        let (digits, unit) = s.split_at(s.len() - 1);
        let n: u64 = digits.parse().ok()?;
        Some(match unit {
            "H" => Duration::from_secs(n * 3600),
            "M" => Duration::from_secs(n * 60),
            "S" => Duration::from_secs(n),
            "m" => Duration::from_millis(n),
            "u" => Duration::from_micros(n),
            "n" => Duration::from_nanos(n),
            _ => return None,
        })
    }

    /// Headroom kept before the caller's deadline: tonic's server enforces
    /// `grpc-timeout` itself and answers CANCELLED, so wavefront answers
    /// DEADLINE_EXCEEDED (and frees the request's slots) this much earlier.
    pub fn margin(timeout: Duration) -> Duration {
        (timeout / 20).clamp(Duration::from_millis(5), Duration::from_millis(250))
    }

    /// The deadline to enforce for a call whose caller sent `grpc-timeout`
    /// (already shortened by [`margin`]); an error message for a malformed header.
    pub fn deadline(md: &tonic::metadata::MetadataMap) -> Result<Option<Instant>, String> {
        let Some(v) = md.get("grpc-timeout") else {
            return Ok(None);
        };
        let s = v
            .to_str()
            .map_err(|_| "grpc-timeout header is not ASCII".to_owned())?;
        let d = parse(s).ok_or_else(|| format!("grpc-timeout header {s:?} is malformed"))?;
        Ok(Some(Instant::now() + d - margin(d)))
    }

    /// Formats a timeout for the header (milliseconds, at least 1).
    pub fn format(d: Duration) -> String {
        let ms = d.as_millis().clamp(1, 99_999_999);
        format!("{ms}m")
    }

    type Boxed<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send>>;

    /// Ends `stream` with DEADLINE_EXCEEDED if it is still running at `deadline`
    /// (dropping it, which cancels the work behind it).
    pub fn with_deadline<T: Send + 'static>(
        stream: Boxed<T>,
        deadline: Option<Instant>,
    ) -> Boxed<T> {
        let Some(deadline) = deadline else {
            return stream;
        };
        let sleep = Box::pin(tokio::time::sleep_until(deadline.into()));
        Box::pin(futures::stream::unfold(
            Some((stream, sleep)),
            |state| async move {
                let (mut stream, mut sleep) = state?;
                tokio::select! {
                    item = futures::StreamExt::next(&mut stream) => item.map(|i| (i, Some((stream, sleep)))),
                    _ = &mut sleep => Some((Err(tonic::Status::deadline_exceeded("deadline exceeded while generating; partial output discarded")), None)),
                }
            },
        ))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn parses_the_wire_format() {
            assert_eq!(parse("100m"), Some(Duration::from_millis(100)));
            assert_eq!(parse("2S"), Some(Duration::from_secs(2)));
            assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
            assert_eq!(parse("5x"), None);
            assert_eq!(parse("m"), None);
            assert_eq!(parse("123456789m"), None);
        }
    }
}
