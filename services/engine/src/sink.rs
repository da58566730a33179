//! Where a request's events go: the per-request response channel a transport implements.

use crate::error::EngineError;
use crate::event::Event;
use std::sync::mpsc::{SyncSender, TrySendError};

/// Why a sink did not take an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkError {
    /// The receiver is alive but its bounded buffer is full: try again later.
    Full,
    /// The receiver is gone: the request is cancelled.
    Closed,
}

/// The per-request response channel, implemented by the transport (a bounded
/// tokio channel in the worker). It must never block.
pub trait EventSink: Send {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)>;
    fn is_closed(&self) -> bool;
    /// The transport decided the response is complete (a stop string appeared in its text)
    /// and still listens: the engine finishes the request at its next step with
    /// [`FinishReason::StopString`](crate::FinishReason::StopString) and the program's
    /// statistics so far ([`Family::stop`](crate::Family::stop)), instead of dropping it as
    /// a cancelled one.
    fn stop_requested(&self) -> bool {
        false
    }

    /// The engine gives up on the request with `error` (its client left its events unread
    /// past the write timeout) and drops the sink: the transport should answer `error` once
    /// its reader gets past what is buffered. The default sends it if there is room.
    fn abandon(&mut self, error: EngineError) {
        let _ = self.try_send(Event::Failed(error));
    }
}

/// A bounded std channel is a sink for callers without an async runtime
/// (offline generation, benchmarks); it learns that its receiver is gone
/// only when a send fails.
impl EventSink for SyncSender<Event> {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        SyncSender::try_send(self, event).map_err(|e| match e {
            TrySendError::Full(ev) => (SinkError::Full, ev),
            TrySendError::Disconnected(ev) => (SinkError::Closed, ev),
        })
    }

    fn is_closed(&self) -> bool {
        false
    }
}
