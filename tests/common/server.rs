//! A server on the trained family for the API suites (chat tools, Messages, Responses).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use mtp::base::Tokenizer;
use mtp::drafter::{Drafter, MtpDrafter};
use mtp::engine::{DraftLen, EngineOptions};
use mtp::server::{Server, ServerOptions};

/// The model name the trained server answers to.
pub const MODEL: &str = "mtp-trained";

/// A server on the trained family with its MTP head, batch 8, adaptive k, named [`MODEL`];
/// the chat template from `template_dir` (the checkpoint's own when `None`), the rest of
/// `options` as given.
pub fn trained_server(template_dir: Option<&Path>, options: ServerOptions) -> SocketAddr {
    let dir = super::trained("target");
    let model = Arc::new(super::load(&dir));
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let (d, m) = (dir.clone(), model.clone());
    let make = Box::new(move || Ok(Some(Box::new(MtpDrafter::load(&d, m)?) as Box<dyn Drafter>)));
    let opts = EngineOptions { max_batch: 8, k: DraftLen::Adaptive(4), ..EngineOptions::default() };
    let options = ServerOptions { model_name: MODEL.into(), ..options };
    let server = Server::start(template_dir.unwrap_or(&dir), model, Some(tok), make, opts, options).unwrap();
    server.spawn("127.0.0.1:0".parse().unwrap()).unwrap()
}
