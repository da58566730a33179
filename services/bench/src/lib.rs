//! Pieces shared by the bench binaries: serving requests through the engine and timing them
//! ([`run`]), and the markdown tables they print and the aggregates in their cells ([`table`]).

pub mod run;
pub mod table;
