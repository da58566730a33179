//! Models of each family's checkpoint layout with random weights, for timing without a
//! checkpoint: Huginn ([`huginn`]), LLaDA ([`llada`]), ARMT on Llama ([`armt`]) and
//! ReFusion's Qwen3 ([`qwen3`]).

pub mod armt;
pub mod huginn;
pub mod llada;
pub mod qwen3;
