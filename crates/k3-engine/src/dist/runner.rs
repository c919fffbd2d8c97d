//! The runner interface and ranks as threads (to be written).
