//! One process per rank: launch, rendezvous and NCCL groups (to be written).
