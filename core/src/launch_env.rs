//! Who this process is in the job, read from the environment its launcher set.

use crate::error::{Error, Result};
use crate::rendezvous::NONCE_VAR;
pub use crate::rendezvous::{JobNonce, Rendezvous};
use std::path::PathBuf;

/// How NVSHMEM's PEs find each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bootstrap {
    /// Rank 0 creates a unique id and hands it to the others through a [`Rendezvous`]
    /// (lasp-run, torchrun-style variables, or a single process).
    UniqueId(Rendezvous),
    /// NVSHMEM's own PMI bootstrap (nvshmrun, Hydra, Slurm).
    Pmi,
    /// NVSHMEM's MPI bootstrap plugin (mpirun).
    Mpi,
    /// None: another library of this process initialised NVSHMEM and lasp-shmem joined it
    /// ([`Runtime::attach`](crate::Runtime::attach)).
    Guest,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Index of this process among those on its node: it selects the GPU.
    pub local_rank: usize,
    pub local_world_size: usize,
    pub bootstrap: Bootstrap,
}

impl LaunchEnv {
    /// Reads the launch variables of the process environment. A value that is not UTF-8 is read
    /// with its invalid bytes replaced, so a number shows up as malformed instead of as unset.
    pub fn from_process_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the launch variables through `get`, in this order: `LASP_BOOTSTRAP` (uid, mpi or
    /// pmi) forces a mode; torchrun-style `RANK`/`WORLD_SIZE` (lasp-run sets these) select the
    /// unique-id bootstrap; Open MPI's `OMPI_COMM_WORLD_*` select MPI; `PMI_RANK`/`PMI_SIZE`
    /// (nvshmrun, Hydra) or `SLURM_PROCID` select PMI; none of them means a single process.
    /// `LASP_RENDEZVOUS_NONCE`, when set, ties the unique-id rendezvous to one job (see
    /// [`crate::rendezvous`]).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::Launch(format!(
                        "{name}={v:?} is not a non-negative integer; fix the launch environment"
                    ))
                }),
            }
        };
        let nonce = || get(NONCE_VAR).map(|v| JobNonce::new(&v)).transpose();
        let forced = get("LASP_BOOTSTRAP").map(|v| v.to_ascii_lowercase());
        let torch = (num("RANK")?, num("WORLD_SIZE")?);
        let ompi = (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?);
        let pmi = (num("PMI_RANK")?, num("PMI_SIZE")?);
        let slurm = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?);

        let (rank, world_size, local_rank, local_world_size, mode) =
            if let (Some(r), Some(w)) = torch {
                (
                    r,
                    w,
                    num("LOCAL_RANK")?.unwrap_or(r),
                    num("LOCAL_WORLD_SIZE")?.unwrap_or(w),
                    "uid",
                )
            } else if let (Some(r), Some(w)) = ompi {
                let local = num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(r);
                (
                    r,
                    w,
                    local,
                    num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(w),
                    "mpi",
                )
            } else if let (Some(r), Some(w)) = pmi {
                let local = num("MPI_LOCALRANKID")?
                    .or(num("PMI_LOCAL_RANK")?)
                    .unwrap_or(r);
                (r, w, local, num("MPI_LOCALNRANKS")?.unwrap_or(w), "pmi")
            } else if let (Some(r), Some(w)) = slurm {
                (
                    r,
                    w,
                    num("SLURM_LOCALID")?.unwrap_or(r),
                    num("SLURM_NTASKS_PER_NODE")?.unwrap_or(w),
                    "pmi",
                )
            } else {
                (0, 1, 0, 1, "uid")
            };
        check_rank(rank, world_size, "fix the launcher's rank variables")?;
        if local_rank >= local_world_size {
            return Err(Error::Launch(format!(
                "local rank {local_rank} is not below the local world size {local_world_size}; fix the launcher's local-rank variables"
            )));
        }
        let bootstrap = match forced.as_deref().unwrap_or(mode) {
            "mpi" => Bootstrap::Mpi,
            "pmi" => Bootstrap::Pmi,
            "uid" => Bootstrap::UniqueId(if let Some(file) = get("LASP_RENDEZVOUS_FILE") {
                Rendezvous::File {
                    path: PathBuf::from(file),
                    nonce: nonce()?,
                }
            } else if world_size == 1 {
                Rendezvous::Alone
            } else {
                let addr = get("MASTER_ADDR").ok_or_else(|| {
                    Error::Launch(format!(
                        "{world_size} ranks need a rendezvous: set MASTER_ADDR and MASTER_PORT (lasp-run and torchrun do) or LASP_RENDEZVOUS_FILE"
                    ))
                })?;
                let port = get("MASTER_PORT");
                let port = port
                    .as_deref()
                    .and_then(|p| p.trim().parse::<u16>().ok())
                    .filter(|&p| p > 0)
                    .ok_or_else(|| {
                        Error::Launch(match &port {
                            Some(p) => format!("MASTER_PORT={p:?} is not a TCP port (1-65535)"),
                            None => "MASTER_PORT must be set to a TCP port (1-65535)".into(),
                        })
                    })?;
                Rendezvous::Tcp {
                    addr,
                    port,
                    nonce: nonce()?,
                }
            }),
            other => {
                return Err(Error::Launch(format!(
                    "LASP_BOOTSTRAP={other:?} is not one of uid, mpi, pmi"
                )))
            }
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            bootstrap,
        })
    }

    /// A place in a job the caller describes itself, bootstrapped by unique id through
    /// `rendezvous` (for a trainer that already runs its own launcher and collectives).
    pub fn explicit(
        rank: usize,
        world_size: usize,
        local_rank: usize,
        local_world_size: usize,
        rendezvous: Rendezvous,
    ) -> Result<Self> {
        check_rank(
            rank,
            world_size,
            "pass this process's rank and the job's world size (torch.distributed: get_rank(), \
             get_world_size())",
        )?;
        if local_rank >= local_world_size || local_world_size > world_size {
            return Err(Error::Launch(format!(
                "local rank {local_rank} of {local_world_size} on this node (world size \
                 {world_size}) is impossible; pass LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun \
                 sets them (the local rank selects the GPU)"
            )));
        }
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            bootstrap: Bootstrap::UniqueId(rendezvous),
        })
    }

    /// Whether every rank runs on this node, so no network transport is needed.
    pub fn single_node(&self) -> bool {
        self.local_world_size == self.world_size
    }
}

/// The rank must lie inside a non-empty world; `fix` says what to do about it.
fn check_rank(rank: usize, world_size: usize, fix: &str) -> Result<()> {
    if world_size == 0 || rank >= world_size {
        return Err(Error::Launch(format!(
            "rank {rank} is not below the world size {world_size}; {fix}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn an_explicit_place_is_checked() {
        let e = LaunchEnv::explicit(3, 8, 3, 4, Rendezvous::Given([5; 128])).unwrap();
        assert!(!e.single_node());
        assert_eq!(
            e.bootstrap,
            Bootstrap::UniqueId(Rendezvous::Given([5; 128]))
        );
        let msg = LaunchEnv::explicit(4, 4, 0, 4, Rendezvous::Alone)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("rank 4 is not below the world size 4"),
            "{msg}"
        );
        let msg = LaunchEnv::explicit(1, 4, 2, 2, Rendezvous::Alone)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("local rank 2 of 2"), "{msg}");
        assert!(LaunchEnv::explicit(0, 2, 0, 4, Rendezvous::Alone).is_err());
    }

    #[test]
    fn no_launcher_means_one_process() {
        let e = env(&[]).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (0, 1, 0));
        assert_eq!(e.bootstrap, Bootstrap::UniqueId(Rendezvous::Alone));
    }

    #[test]
    fn torchrun_variables_select_the_tcp_rendezvous() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 8, 1, 4)
        );
        assert_eq!(
            e.bootstrap,
            Bootstrap::UniqueId(Rendezvous::Tcp {
                addr: "10.0.0.1".into(),
                port: 29500,
                nonce: None,
            })
        );
        assert!(!e.single_node());
    }

    #[test]
    fn a_job_nonce_goes_with_the_rendezvous() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let e = env(&[&base[..], &[("LASP_RENDEZVOUS_NONCE", "abc123")]].concat()).unwrap();
        assert_eq!(
            e.bootstrap,
            Bootstrap::UniqueId(Rendezvous::Tcp {
                addr: "127.0.0.1".into(),
                port: 29500,
                nonce: Some(JobNonce::new("abc123").unwrap()),
            })
        );
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LASP_RENDEZVOUS_FILE", "/shared/id"),
            ("LASP_RENDEZVOUS_NONCE", "abc123"),
        ])
        .unwrap();
        assert_eq!(
            e.bootstrap,
            Bootstrap::UniqueId(Rendezvous::File {
                path: "/shared/id".into(),
                nonce: Some(JobNonce::new("abc123").unwrap()),
            })
        );
        let msg = env(&[&base[..], &[("LASP_RENDEZVOUS_NONCE", "not a nonce")]].concat())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("LASP_RENDEZVOUS_NONCE must be"), "{msg}");
    }

    #[test]
    fn open_mpi_selects_mpi_and_hydra_selects_pmi() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.local_rank, e.bootstrap.clone()),
            (2, 2, Bootstrap::Mpi)
        );
        assert!(e.single_node());
        let e = env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.local_rank, e.bootstrap), (1, 1, Bootstrap::Pmi));
    }

    #[test]
    fn bad_or_missing_variables_say_what_to_set() {
        let msg = env(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("MASTER_ADDR"), "{msg}");
        let msg = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("rank 2 is not below the world size 2"),
            "{msg}"
        );
        let msg = env(&[("RANK", "x")]).unwrap_err().to_string();
        assert!(msg.contains("RANK=\"x\""), "{msg}");
        for port in ["0", "65536", "http"] {
            let msg = env(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "x"),
                ("MASTER_PORT", port),
            ])
            .unwrap_err()
            .to_string();
            assert!(
                msg.contains(&format!("MASTER_PORT={port:?} is not a TCP port")),
                "{msg}"
            );
        }
        let msg = env(&[("LASP_BOOTSTRAP", "carrier-pigeon")])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not one of uid, mpi, pmi"), "{msg}");
    }

    #[test]
    fn a_rendezvous_file_overrides_tcp() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LASP_RENDEZVOUS_FILE", "/shared/id"),
        ])
        .unwrap();
        assert_eq!(
            e.bootstrap,
            Bootstrap::UniqueId(Rendezvous::File {
                path: "/shared/id".into(),
                nonce: None,
            })
        );
    }
}
