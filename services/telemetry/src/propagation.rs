//! W3C trace context in gRPC metadata.
//!
//! The router extracts the caller's `traceparent` into its request span and
//! injects the span's context into the call it makes to the worker; the
//! worker extracts it again. Metadata keys are lower-case HTTP/2 headers.

use opentelemetry::propagation::{Extractor, Injector};
use tonic::metadata::{KeyAndValueRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Reads propagation fields from incoming metadata.
pub struct MetadataExtractor<'a>(pub &'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .iter()
            .filter_map(|kv| match kv {
                KeyAndValueRef::Ascii(k, _) => Some(k.as_str()),
                KeyAndValueRef::Binary(_, _) => None,
            })
            .collect()
    }
}

/// Writes propagation fields into outgoing metadata.
pub struct MetadataInjector<'a>(pub &'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// Makes `span` a child of the trace context found in `metadata`, if any.
pub fn extract_parent(span: &tracing::Span, metadata: &MetadataMap) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    let _ = span.set_parent(cx);
}

/// Writes `span`'s trace context into `metadata` for the next hop.
pub fn inject_current(span: &tracing::Span, metadata: &mut MetadataMap) {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata))
    });
}
