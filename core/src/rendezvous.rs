//! Hands rank 0's NVSHMEM unique id to every other rank, over TCP or through a shared file.
//!
//! # The job nonce
//!
//! Without more, the exchange trusts whoever answers: rank 0 serves the id to any process that
//! sends the 8-byte greeting, and a file left at `LASP_RENDEZVOUS_FILE` by an earlier job is
//! taken as this job's id by every other rank. A launcher that sets `LASP_RENDEZVOUS_NONCE` (a
//! per-job secret, the same for every rank; `lasp-run` does) closes both: rank 0 then serves the
//! id only to greetings that carry the nonce, and the file holds the nonce before the id, so a
//! stale file or another job's rank 0 is ignored until this job's appears. Without the variable
//! (torchrun, an older launcher) the exchange is the one described above, byte for byte.
//!
//! Wire format, TCP: a rank sends `LASP` + its rank (u32, little-endian), or with a nonce `LASN` +
//! its rank + the nonce's length (one byte) + the nonce; rank 0 answers with the 128-byte id.
//! File: the 128-byte id, or with a nonce `LASN` + the nonce's length (one byte) + the nonce + the
//! id.

use crate::error::{Error, Result};
use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Size of the id (`nvshmemx_uniqueid_t`).
pub const ID_BYTES: usize = 128;
/// A connecting rank's greeting: this magic, then its rank as u32 little-endian.
const HELLO: &[u8; 4] = b"LASP";
/// The greeting of a rank that carries a job nonce (and the file header with one).
const HELLO_NONCE: &[u8; 4] = b"LASN";
/// The environment variable that carries the job nonce.
pub const NONCE_VAR: &str = "LASP_RENDEZVOUS_NONCE";

/// Where the unique id is exchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// One process: nothing to exchange.
    Alone,
    /// Rank 0 serves the id over TCP on `MASTER_ADDR:MASTER_PORT` (to greetings that carry
    /// `nonce`, when there is one).
    Tcp {
        addr: String,
        port: u16,
        nonce: Option<JobNonce>,
    },
    /// Rank 0 writes the id to a file every rank can read (`LASP_RENDEZVOUS_FILE`), after
    /// `nonce` when there is one.
    File {
        path: PathBuf,
        nonce: Option<JobNonce>,
    },
    /// The caller already handed rank 0's id to every rank (a trainer's own collective, through
    /// the C ABI): nothing left to exchange.
    Given([u8; ID_BYTES]),
}

/// A per-job secret that ties the ranks of one job together at the rendezvous: 1 to 64 ASCII
/// letters, digits, `-` or `_`. Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobNonce(String);

impl JobNonce {
    /// The longest nonce (it travels behind a one-byte length).
    pub const MAX_LEN: usize = 64;

    /// `text` as a nonce, or an error that says what a nonce looks like.
    pub fn new(text: &str) -> Result<Self> {
        let ok = (1..=Self::MAX_LEN).contains(&text.len())
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(Error::Launch(format!(
                "{NONCE_VAR} must be 1 to {} ASCII letters, digits, '-' or '_' (got {} \
                 characters); let the launcher set it, or unset it",
                Self::MAX_LEN,
                text.len()
            )));
        }
        Ok(JobNonce(text.to_string()))
    }

    /// A fresh random nonce: 32 hex digits from the operating system's random source.
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| {
                Error::Launch(format!("cannot read /dev/urandom for the job nonce: {e}"))
            })?;
        Ok(JobNonce(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// The nonce as the environment carries it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Length (one byte) + nonce, as greetings and the file carry it after their `LASN`.
    fn tagged(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.0.len());
        out.push(self.0.len() as u8);
        out.extend_from_slice(self.0.as_bytes());
        out
    }
}

impl fmt::Debug for JobNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobNonce(..)")
    }
}

/// Rank 0 calls `make` and serves its result; every other rank receives it. Returns the id on
/// every rank, or an error naming what did not arrive before `timeout`.
pub fn share_id(
    rendezvous: &Rendezvous,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    make: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    let deadline = Instant::now() + timeout;
    match rendezvous {
        Rendezvous::Alone => make(),
        Rendezvous::Given(id) => Ok(*id),
        Rendezvous::Tcp { addr, port, nonce } if rank == 0 => {
            // Bind before making the id, so ranks that connect early are queued, not refused.
            let listener = TcpListener::bind(("0.0.0.0", *port)).map_err(|e| {
                Error::Rendezvous(format!(
                    "rank 0 cannot listen on port {port} ({e}); pick a free MASTER_PORT"
                ))
            })?;
            let id = make()?;
            serve(
                listener,
                &id,
                world_size,
                nonce.as_ref(),
                deadline,
                &format!("{addr}:{port}"),
            )?;
            Ok(id)
        }
        Rendezvous::Tcp { addr, port, nonce } => fetch(addr, *port, rank, nonce.as_ref(), deadline),
        Rendezvous::File { path, nonce } if rank == 0 => {
            let id = make()?;
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, file_contents(&id, nonce.as_ref()))
                .and_then(|()| std::fs::rename(&tmp, path))
                .map_err(|e| Error::Rendezvous(format!("rank 0 cannot write {} ({e}); LASP_RENDEZVOUS_FILE must be writable and on a file system every rank sees", path.display())))?;
            Ok(id)
        }
        Rendezvous::File { path, nonce } => read_file(path, nonce.as_ref(), deadline),
    }
}

/// What rank 0 writes to the rendezvous file.
fn file_contents(id: &[u8; ID_BYTES], nonce: Option<&JobNonce>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(nonce) = nonce {
        out.extend_from_slice(HELLO_NONCE);
        out.extend_from_slice(&nonce.tagged());
    }
    out.extend_from_slice(id);
    out
}

/// The id in a rendezvous file's contents, if they are this job's.
fn id_from_file(contents: &[u8], nonce: Option<&JobNonce>) -> Option<[u8; ID_BYTES]> {
    let id = match nonce {
        None => contents,
        Some(nonce) => contents
            .strip_prefix(HELLO_NONCE.as_slice())?
            .strip_prefix(nonce.tagged().as_slice())?,
    };
    <[u8; ID_BYTES]>::try_from(id).ok()
}

/// The greeting of rank `rank`.
fn hello(rank: usize, nonce: Option<&JobNonce>) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 1 + JobNonce::MAX_LEN);
    out.extend_from_slice(if nonce.is_some() { HELLO_NONCE } else { HELLO });
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    if let Some(nonce) = nonce {
        out.extend_from_slice(&nonce.tagged());
    }
    out
}

/// Reads a greeting from `stream`: the rank it names, or `None` if it is not one of this job's
/// (another program, another job's rank, a rank without this job's nonce).
fn read_hello(stream: &mut impl Read, nonce: Option<&JobNonce>) -> Option<usize> {
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).ok()?;
    let rank = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
    match nonce {
        None => (&head[..4] == HELLO).then_some(rank),
        Some(nonce) => {
            if &head[..4] != HELLO_NONCE {
                return None;
            }
            let mut len = [0u8; 1];
            stream.read_exact(&mut len).ok()?;
            let mut theirs = vec![0u8; len[0] as usize];
            stream.read_exact(&mut theirs).ok()?;
            (theirs == nonce.as_str().as_bytes()).then_some(rank)
        }
    }
}

fn serve(
    listener: TcpListener,
    id: &[u8; ID_BYTES],
    world_size: usize,
    nonce: Option<&JobNonce>,
    deadline: Instant,
    at: &str,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Rendezvous(format!("rendezvous socket: {e}")))?;
    let mut served = vec![false; world_size];
    served[0] = true;
    while served.iter().any(|done| !done) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false).ok();
                stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
                let Some(peer) = read_hello(&mut stream, nonce) else {
                    continue; // not one of ours (a port scanner, a stale job): ignore it
                };
                if peer < world_size && stream.write_all(id).is_ok() {
                    served[peer] = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<usize> = (0..world_size).filter(|&r| !served[r]).collect();
                    let nonce_hint = if nonce.is_some() {
                        format!(" and {NONCE_VAR}")
                    } else {
                        String::new()
                    };
                    return Err(Error::Rendezvous(format!(
                        "rank 0 waited at {at} but ranks {missing:?} never connected; check that every rank was started with the same MASTER_ADDR/MASTER_PORT{nonce_hint} and WORLD_SIZE={world_size}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(Error::Rendezvous(format!("rendezvous accept failed: {e}"))),
        }
    }
    Ok(())
}

fn fetch(
    addr: &str,
    port: u16,
    rank: usize,
    nonce: Option<&JobNonce>,
    deadline: Instant,
) -> Result<[u8; ID_BYTES]> {
    let greeting = hello(rank, nonce);
    let mut last_error = String::from("no attempt");
    while Instant::now() < deadline {
        let attempt = (addr, port).to_socket_addrs().and_then(|mut addrs| {
            let target = addrs
                .next()
                .ok_or_else(|| std::io::Error::other("address did not resolve"))?;
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(30)))?;
            stream.write_all(&greeting)?;
            let mut id = [0u8; ID_BYTES];
            stream.read_exact(&mut id)?;
            Ok(id)
        });
        match attempt {
            Ok(id) => return Ok(id),
            Err(e) => last_error = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let nonce_hint = if nonce.is_some() {
        format!(" and that it has the same {NONCE_VAR}")
    } else {
        String::new()
    };
    Err(Error::Rendezvous(format!(
        "rank {rank} could not get the NVSHMEM id from rank 0 at {addr}:{port} ({last_error}); check that rank 0 is running, MASTER_ADDR/MASTER_PORT point to it{nonce_hint}"
    )))
}

fn read_file(path: &Path, nonce: Option<&JobNonce>, deadline: Instant) -> Result<[u8; ID_BYTES]> {
    while Instant::now() < deadline {
        if let Some(id) = std::fs::read(path)
            .ok()
            .and_then(|bytes| id_from_file(&bytes, nonce))
        {
            return Ok(id);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(Error::Rendezvous(format!(
        "the NVSHMEM id never appeared in {}; check that rank 0 is running and writes the same LASP_RENDEZVOUS_FILE{}",
        path.display(),
        if nonce.is_some() {
            format!(" with the same {NONCE_VAR}")
        } else {
            String::new()
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seed: u8) -> [u8; ID_BYTES] {
        std::array::from_fn(|i| seed.wrapping_add(i as u8))
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn tcp(port: u16, nonce: Option<&str>) -> Rendezvous {
        Rendezvous::Tcp {
            addr: "127.0.0.1".into(),
            port,
            nonce: nonce.map(|n| JobNonce::new(n).unwrap()),
        }
    }

    /// Every rank of a `world`-rank job through `rdv`; rank 0 makes `id(seed)`.
    fn job(rdv: &Rendezvous, world: usize, seed: u8) -> Vec<Result<[u8; ID_BYTES]>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || {
                        share_id(rdv, rank, world, Duration::from_secs(20), || Ok(id(seed)))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn tcp_hands_rank_zeros_id_to_every_rank() {
        for nonce in [None, Some("job-1")] {
            let got = job(&tcp(free_port(), nonce), 4, 7);
            assert!(
                got.iter().all(|g| *g.as_ref().unwrap() == id(7)),
                "{nonce:?}"
            );
        }
    }

    #[test]
    fn the_greetings_without_a_nonce_are_the_old_bytes() {
        assert_eq!(hello(3, None), b"LASP\x03\0\0\0");
        let nonce = JobNonce::new("ab").unwrap();
        assert_eq!(hello(3, Some(&nonce)), b"LASN\x03\0\0\0\x02ab");
        assert_eq!(read_hello(&mut &b"LASP\x02\0\0\0"[..], None), Some(2));
        // A greeting of the other kind, or with another nonce, is not one of this job's.
        assert_eq!(read_hello(&mut &b"LASP\x02\0\0\0"[..], Some(&nonce)), None);
        assert_eq!(
            read_hello(&mut &b"LASN\x02\0\0\0\x02ac"[..], Some(&nonce)),
            None
        );
        assert_eq!(
            read_hello(&mut &b"LASN\x02\0\0\0\x02ab"[..], Some(&nonce)),
            Some(2)
        );
        assert_eq!(read_hello(&mut &b"LASN\x02\0\0\0\x02ab"[..], None), None);
        assert_eq!(file_contents(&id(1), None), id(1));
    }

    #[test]
    fn rank_zero_serves_only_greetings_with_its_nonce() {
        let port = free_port();
        let server = std::thread::spawn(move || {
            share_id(
                &tcp(port, Some("right")),
                0,
                2,
                Duration::from_secs(20),
                || Ok(id(5)),
            )
        });
        // A rank of another job (another nonce), then one without a nonce, get nothing...
        for other in [Some("wrong"), None] {
            let err = share_id(
                &tcp(port, other),
                1,
                2,
                Duration::from_millis(500),
                || unreachable!(),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("could not get the NVSHMEM id"), "{err}");
        }
        // ... and this job's rank gets the id.
        let got = share_id(
            &tcp(port, Some("right")),
            1,
            2,
            Duration::from_secs(20),
            || unreachable!(),
        );
        assert_eq!(got.unwrap(), id(5));
        assert_eq!(server.join().unwrap().unwrap(), id(5));
    }

    #[test]
    fn nonces_are_checked_and_not_shown() {
        assert!(JobNonce::new("0123abcdEF-_").is_ok());
        for bad in ["", "has space", "é", &"x".repeat(65)] {
            let msg = JobNonce::new(bad).unwrap_err().to_string();
            assert!(msg.contains("LASP_RENDEZVOUS_NONCE must be"), "{msg}");
        }
        let a = JobNonce::generate().unwrap();
        let b = JobNonce::generate().unwrap();
        assert_eq!(a.as_str().len(), 32);
        assert_ne!(a, b);
        assert!(JobNonce::new(a.as_str()).is_ok());
        assert_eq!(format!("{a:?}"), "JobNonce(..)");
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let rdv = tcp(free_port(), None);
        let err = share_id(&rdv, 0, 3, Duration::from_millis(300), || Ok(id(1))).unwrap_err();
        assert!(
            err.to_string().contains("ranks [1, 2] never connected"),
            "{err}"
        );
        let err = share_id(&rdv, 2, 3, Duration::from_millis(300), || unreachable!()).unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 2 could not get the NVSHMEM id"),
            "{err}"
        );
    }

    #[test]
    fn a_given_id_is_used_as_is_on_every_rank() {
        let rdv = Rendezvous::Given(id(9));
        for rank in 0..3 {
            let got = share_id(&rdv, rank, 3, Duration::from_millis(1), || unreachable!());
            assert_eq!(got.unwrap(), id(9));
        }
    }

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("lasp-rdv-test-{name}-{}", std::process::id()))
    }

    #[test]
    fn file_rendezvous_round_trips() {
        for nonce in [None, Some("job-2")] {
            let path = temp_path(nonce.unwrap_or("plain"));
            let rdv = Rendezvous::File {
                path: path.clone(),
                nonce: nonce.map(|n| JobNonce::new(n).unwrap()),
            };
            assert!(job(&rdv, 3, 3)
                .iter()
                .all(|g| *g.as_ref().unwrap() == id(3)));
            std::fs::remove_file(path).unwrap();
        }
    }

    #[test]
    fn a_stale_file_of_another_job_is_ignored_with_a_nonce() {
        let path = temp_path("stale");
        // An earlier job's file, with and without its nonce.
        let old = JobNonce::new("old-job").unwrap();
        for stale in [
            file_contents(&id(1), Some(&old)),
            file_contents(&id(1), None),
        ] {
            std::fs::write(&path, stale).unwrap();
            let rdv = Rendezvous::File {
                path: path.clone(),
                nonce: Some(JobNonce::new("new-job").unwrap()),
            };
            let err = share_id(&rdv, 1, 2, Duration::from_millis(200), || unreachable!())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("never appeared") && err.contains(NONCE_VAR),
                "{err}"
            );
        }
        // Without a nonce the old behaviour stays: whatever 128-byte id is there is taken.
        let rdv = Rendezvous::File {
            path: path.clone(),
            nonce: None,
        };
        let got = share_id(&rdv, 1, 2, Duration::from_millis(200), || unreachable!());
        assert_eq!(got.unwrap(), id(1));
        std::fs::remove_file(path).unwrap();
    }
}
