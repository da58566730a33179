//! A served model's tokenizer over the API (`Tokenize`, `Detokenize`, `GetTokenizer`, on the
//! public API and on the worker's): the same conversions `Generate` makes, so a client (an
//! evaluation harness's tokenizer, a prompt budget check) sees exactly the ids its requests
//! become. Work in proportion to the input runs off the runtime's threads, after the same
//! size checks as a prompt's.

use std::sync::Arc;

use tonic::Status;
use wavefront_models::ChatMessage;
use wavefront_proto::v1 as pb;
use wavefront_schemes::ServedModel;

use crate::service::WorkerService;

fn no_tokenizer(model: &dyn ServedModel) -> Status {
    Status::failed_precondition(format!(
        "model {:?} was loaded without a tokenizer: send token ids",
        model.info().name
    ))
}

impl WorkerService {
    pub(crate) async fn run_tokenize(
        &self,
        req: pb::TokenizeRequest,
    ) -> Result<pb::TokenizeResponse, Status> {
        let model = self.pick(&req.model)?;
        self.limits().check_tokenize(&req, model.as_ref())?;
        let name = model.info().name.clone();
        let max_context = model.info().max_context as u32;
        let ids = blocking(model, move |model| {
            let tok = model.tokenizer().ok_or_else(|| no_tokenizer(model))?;
            match req.input {
                None => Err(Status::invalid_argument(
                    "set `text` or `chat`: nothing to tokenize",
                )),
                Some(pb::tokenize_request::Input::Text(text)) => match req.add_special_tokens {
                    Some(add) => tok.encode(&text, add),
                    None => return model.encode_prompt(&text).map_err(bad),
                }
                .map_err(|e| Status::invalid_argument(format!("cannot tokenize the text: {e}"))),
                Some(pb::tokenize_request::Input::Chat(chat)) => {
                    if chat.messages.is_empty() {
                        return Err(Status::invalid_argument("chat has no messages"));
                    }
                    let messages: Vec<ChatMessage> = chat
                        .messages
                        .iter()
                        .map(|m| ChatMessage::new(&m.role, &m.content))
                        .collect();
                    model.encode_chat(&messages).map_err(|e| {
                        Status::invalid_argument(format!("cannot format the chat prompt: {e}"))
                    })
                }
            }
        })
        .await?;
        Ok(pb::TokenizeResponse {
            model: name,
            token_ids: ids,
            max_context,
        })
    }

    pub(crate) async fn run_detokenize(
        &self,
        req: pb::DetokenizeRequest,
    ) -> Result<pb::DetokenizeResponse, Status> {
        let model = self.pick(&req.model)?;
        let vocab = model.info().vocab_size;
        if let Some((i, id)) = req
            .token_ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            return Err(Status::invalid_argument(format!(
                "token id {id} at index {i} is outside the vocabulary (size {vocab})"
            )));
        }
        let name = model.info().name.clone();
        let skip = req.skip_special_tokens.unwrap_or(true);
        let text = blocking(model, move |model| {
            let tok = model.tokenizer().ok_or_else(|| no_tokenizer(model))?;
            tok.decode(&req.token_ids, skip)
                .map_err(|e| Status::invalid_argument(format!("cannot decode the ids: {e}")))
        })
        .await?;
        Ok(pb::DetokenizeResponse { model: name, text })
    }

    pub(crate) fn tokenizer_info(
        &self,
        req: pb::GetTokenizerRequest,
    ) -> Result<pb::TokenizerInfo, Status> {
        let model = self.pick(&req.model)?;
        let info = model.info();
        let tok = model
            .tokenizer()
            .ok_or_else(|| no_tokenizer(model.as_ref()))?;
        let template = tok.chat_template();
        let eos_ids = model.eos_token_ids();
        let special = |name: &str, id: Option<u32>| {
            template
                .and_then(|t| t.special(name))
                .map(str::to_owned)
                .or_else(|| id.and_then(|id| tok.id_to_token(id)))
                .unwrap_or_default()
        };
        Ok(pb::TokenizerInfo {
            model: info.name.clone(),
            bos_token: special("bos_token", None),
            eos_token: special("eos_token", eos_ids.first().copied()),
            pad_token: special("pad_token", None),
            chat_template: template.map(|t| t.source().to_owned()).unwrap_or_default(),
            vocab_size: info.vocab_size as u32,
            max_context: info.max_context as u32,
            eos_token_ids: eos_ids,
        })
    }
}

fn bad(e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("cannot tokenize the text: {e}"))
}

/// Runs `f` on a blocking thread (tokenizing takes time in proportion to the input).
async fn blocking<T: Send + 'static>(
    model: Arc<dyn ServedModel>,
    f: impl FnOnce(&dyn ServedModel) -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(move || f(model.as_ref()))
        .await
        .map_err(|e| Status::internal(format!("tokenizer task failed: {e}")))?
}
