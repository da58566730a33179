//! A request's state as bytes, for moving it to another worker (`ExportRequest` /
//! `ResumeRequest` on the worker API).
//!
//! A program is exported after its family preempted it (its pages and latent tensors are host
//! copies then) and encoded with serde as postcard bytes: page tables and slot ids are not part
//! of it (the importing engine grants its own), the pages' rows, latent tensors, memories and
//! every counter, schedule and random-number generator position are. An imported program is a
//! preempted one: it resumes through its family's `resume`, in whatever slots are free there.
//!
//! [`STATE_VERSION`] names the encoding: a program type that changes its fields bumps it, and a
//! worker refuses state of another version.

use std::borrow::Borrow;

use candle_core::Device;
use wavefront_engine::Phase;

use crate::SchemeError;
use rand::SeedableRng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The version of the exported program encoding (see the module doc).
pub const STATE_VERSION: u32 = 4;

/// Every random-number generator a request owns: ChaCha with 12 rounds (the generator behind
/// `rand`'s `StdRng`, named so its position can be exported).
pub type RequestRng = rand_chacha::ChaCha12Rng;

/// A seeded [`RequestRng`].
pub fn request_rng(seed: u64) -> RequestRng {
    RequestRng::seed_from_u64(seed)
}

#[derive(Serialize, Deserialize)]
struct RngPosition {
    seed: [u8; 32],
    stream: u64,
    word_pos: u128,
}

/// `#[serde(with = "crate::migrate::rng")]` for a [`RequestRng`] (or a boxed one): its seed,
/// stream and position, so the next draw after a move is the next draw of the same sequence.
pub mod rng {
    use super::*;

    pub fn serialize<S: Serializer, R: Borrow<RequestRng>>(r: &R, s: S) -> Result<S::Ok, S::Error> {
        let r: &RequestRng = r.borrow();
        RngPosition {
            seed: r.get_seed(),
            stream: r.get_stream(),
            word_pos: r.get_word_pos(),
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, R: From<RequestRng>>(
        d: D,
    ) -> Result<R, D::Error> {
        let p = RngPosition::deserialize(d)?;
        let mut r = RequestRng::from_seed(p.seed);
        r.set_stream(p.stream);
        r.set_word_pos(p.word_pos);
        Ok(R::from(r))
    }
}

/// `Family::export` of every family: the program's bytes (after its preemption).
pub(crate) fn export<P: Serialize>(
    program: &P,
    family: &'static str,
) -> Result<Vec<u8>, wavefront_engine::FamilyError> {
    encode(program).map_err(|e| wavefront_engine::FamilyError::program(family, Phase::Export, e))
}

/// [`export`], unless the program is `constrained`: a structured-output request's grammar
/// parser does not move, so the export is refused and the request finishes on its worker (the
/// engine keeps a request whose export fails, as a preempted one).
pub(crate) fn export_unless_constrained<P: Serialize>(
    program: &P,
    family: &'static str,
    constrained: bool,
) -> Result<Vec<u8>, wavefront_engine::FamilyError> {
    if constrained {
        return Err(wavefront_engine::FamilyError::program(
            family,
            Phase::Export,
            SchemeError::inconsistent(
                "a structured-output request finishes on the worker it started on: its \
                 grammar parser does not move",
            ),
        ));
    }
    export(program, family)
}

/// A program's bytes.
pub fn encode<T: Serialize>(program: &T) -> Result<Vec<u8>, SchemeError> {
    postcard::to_stdvec(program).map_err(|source| SchemeError::State {
        what: "cannot encode",
        source,
    })
}

/// A program from its bytes; host pages in it go back to `device` when it resumes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], device: &Device) -> Result<T, SchemeError> {
    wavefront_models::state::with_target(device, || postcard::from_bytes(bytes)).map_err(|source| {
        SchemeError::State {
            what: "malformed",
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore};

    #[derive(Serialize, Deserialize)]
    struct Holder {
        #[serde(with = "rng")]
        r: RequestRng,
        #[serde(with = "rng")]
        b: Box<RequestRng>,
    }

    #[test]
    fn a_generator_moved_mid_sequence_continues_the_same_sequence() -> Result<(), SchemeError> {
        let mut a = request_rng(7);
        let mut b = Box::new(request_rng(9));
        // An odd number of 32-bit draws: the position is mid-block and mid-word pair.
        for _ in 0..37 {
            a.next_u32();
            b.random::<f64>();
        }
        let bytes = encode(&Holder {
            r: a.clone(),
            b: b.clone(),
        })?;
        let mut back: Holder = decode(&bytes, &Device::Cpu)?;
        for _ in 0..100 {
            assert_eq!(back.r.next_u64(), a.next_u64());
            assert_eq!(
                back.b.random::<f32>().to_bits(),
                b.random::<f32>().to_bits()
            );
        }
        // The generator is the one behind `StdRng`.
        let mut std = rand::rngs::StdRng::seed_from_u64(3);
        let mut ours = request_rng(3);
        assert_eq!(std.next_u64(), ours.next_u64());
        Ok(())
    }
}
