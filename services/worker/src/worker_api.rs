//! The router's API of a worker (`wavefront.worker.v1.Worker`): generate with the request's
//! engine id in the response headers, load reports, and moving requests between workers
//! ([`crate::migrate`]).

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use wavefront_proto::v1 as pb;
use wavefront_proto::worker::v1 as wpb;

use crate::migrate;
use crate::service::WorkerService;
use crate::stream::EventStream;

type LoadStream = Pin<Box<dyn Stream<Item = Result<wpb::LoadReport, Status>> + Send>>;

#[tonic::async_trait]
impl wpb::worker_server::Worker for WorkerService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let (stream, id) = self.start(request).await?;
        Ok(migrate::with_request_id(Response::new(stream), id))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        self.run_tokenize(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        self.run_detokenize(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_tokenizer(
        &self,
        request: Request<pb::GetTokenizerRequest>,
    ) -> Result<Response<pb::TokenizerInfo>, Status> {
        self.tokenizer_info(request.into_inner()).map(Response::new)
    }

    type ExportRequestStream = migrate::ChunkStream;

    async fn export_request(
        &self,
        request: Request<wpb::ExportRequestRequest>,
    ) -> Result<Response<Self::ExportRequestStream>, Status> {
        migrate::export(self, request.into_inner())
            .await
            .map(Response::new)
    }

    type ResumeRequestStream = EventStream;

    async fn resume_request(
        &self,
        request: Request<tonic::Streaming<wpb::MigrationChunk>>,
    ) -> Result<Response<Self::ResumeRequestStream>, Status> {
        let (stream, id) = migrate::resume(self, request).await?;
        Ok(migrate::with_request_id(Response::new(stream), id))
    }

    async fn finish_export(
        &self,
        request: Request<wpb::FinishExportRequest>,
    ) -> Result<Response<wpb::FinishExportResponse>, Status> {
        migrate::finish(self, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn get_load(
        &self,
        _request: Request<wpb::LoadRequest>,
    ) -> Result<Response<wpb::LoadReport>, Status> {
        Ok(Response::new(self.load_report()))
    }

    type WatchLoadStream = LoadStream;

    async fn watch_load(
        &self,
        request: Request<wpb::LoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let ms = match request.into_inner().interval_ms {
            0 => 500,
            n => n.clamp(10, 60_000),
        };
        let this = self.clone();
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_millis(u64::from(ms)),
        ));
        Ok(Response::new(Box::pin(
            ticks.map(move |_| Ok(this.load_report())),
        )))
    }
}
