//! Pieces shared by the bench binaries: serving requests through the engine and timing them
//! ([`run`]), the markdown tables they print and the aggregates in their cells ([`table`]), and
//! the random weights of their synthetic models ([`weights`]) and the models themselves
//! ([`synthetic`]).

pub mod run;
pub mod synthetic;
pub mod table;
pub mod weights;
