//! Conversion pipeline. STUB.
