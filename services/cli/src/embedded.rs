//! The default model compiled into the binary: the tiny Huginn-0125-layout
//! checkpoint from tests/fixtures, so `wavefront serve` works with no files.

use wavefront_models::ModelFiles;

pub const NAME: &str = "huginn-tiny";

pub fn files() -> ModelFiles {
    ModelFiles::from_embedded(
        include_str!("../../../tests/fixtures/huginn/config.json"),
        include_bytes!("../../../tests/fixtures/huginn/model.safetensors"),
        include_bytes!("../../../tests/fixtures/huginn/tokenizer.json"),
    )
}
