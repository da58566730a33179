//! Protobuf messages and gRPC stubs for `wavefront.v1` (the public API) and
//! `wavefront.worker.v1` (router to worker), generated from `proto/` at build
//! time. The descriptor set feeds server reflection.

#![allow(clippy::all, clippy::pedantic)]

pub mod codec;

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
