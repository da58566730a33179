//! Models of each family's checkpoint layout with random weights, for timing without a
//! checkpoint: Huginn ([`huginn`]), LLaDA ([`llada`]), ARMT on Llama ([`armt`]),
//! ReFusion's Qwen3 ([`qwen3`]), LLaDA2.0 with mixture-of-experts layers ([`llada2`]) and
//! DiffusionGemma ([`diffusion_gemma`]).

pub mod armt;
pub mod diffusion_gemma;
pub mod huginn;
pub mod llada;
pub mod llada2;
pub mod qwen3;
