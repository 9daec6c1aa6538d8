//! CPU f64 reference (in progress).
