//! Hands rank 0's NVSHMEM unique id to every other rank, over TCP or through a shared file.

use crate::error::{Error, Result};
use crate::launch_env::Rendezvous;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

/// Size of the id (`nvshmemx_uniqueid_t`).
pub const ID_BYTES: usize = 128;
/// A connecting rank's greeting: this magic, then its rank as u32 little-endian.
const HELLO: &[u8; 4] = b"LASP";

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
        Rendezvous::Tcp { addr, port } if rank == 0 => {
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
                deadline,
                &format!("{addr}:{port}"),
            )?;
            Ok(id)
        }
        Rendezvous::Tcp { addr, port } => fetch(addr, *port, rank, deadline),
        Rendezvous::File(path) if rank == 0 => {
            let id = make()?;
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, id)
                .and_then(|()| std::fs::rename(&tmp, path))
                .map_err(|e| Error::Rendezvous(format!("rank 0 cannot write {} ({e}); LASP_RENDEZVOUS_FILE must be writable and on a file system every rank sees", path.display())))?;
            Ok(id)
        }
        Rendezvous::File(path) => read_file(path, deadline),
    }
}

fn serve(
    listener: TcpListener,
    id: &[u8; ID_BYTES],
    world_size: usize,
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
                let mut hello = [0u8; 8];
                if stream.read_exact(&mut hello).is_err() || &hello[..4] != HELLO {
                    continue; // not one of ours (a port scanner, a stale job): ignore it
                }
                let peer = u32::from_le_bytes(hello[4..].try_into().unwrap()) as usize;
                if peer < world_size && stream.write_all(id).is_ok() {
                    served[peer] = true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<usize> = (0..world_size).filter(|&r| !served[r]).collect();
                    return Err(Error::Rendezvous(format!(
                        "rank 0 waited at {at} but ranks {missing:?} never connected; check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE={world_size}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(Error::Rendezvous(format!("rendezvous accept failed: {e}"))),
        }
    }
    Ok(())
}

fn fetch(addr: &str, port: u16, rank: usize, deadline: Instant) -> Result<[u8; ID_BYTES]> {
    let mut last_error = String::from("no attempt");
    while Instant::now() < deadline {
        let attempt = (addr, port).to_socket_addrs().and_then(|mut addrs| {
            let target = addrs
                .next()
                .ok_or_else(|| std::io::Error::other("address did not resolve"))?;
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(30)))?;
            let mut hello = [0u8; 8];
            hello[..4].copy_from_slice(HELLO);
            hello[4..].copy_from_slice(&(rank as u32).to_le_bytes());
            stream.write_all(&hello)?;
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
    Err(Error::Rendezvous(format!(
        "rank {rank} could not get the NVSHMEM id from rank 0 at {addr}:{port} ({last_error}); check that rank 0 is running and MASTER_ADDR/MASTER_PORT point to it"
    )))
}

fn read_file(path: &Path, deadline: Instant) -> Result<[u8; ID_BYTES]> {
    while Instant::now() < deadline {
        if let Ok(bytes) = std::fs::read(path) {
            if let Ok(id) = <[u8; ID_BYTES]>::try_from(bytes.as_slice()) {
                return Ok(id);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(Error::Rendezvous(format!(
        "the NVSHMEM id never appeared in {}; check that rank 0 is running and writes the same LASP_RENDEZVOUS_FILE",
        path.display()
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

    #[test]
    fn tcp_hands_rank_zeros_id_to_every_rank() {
        let rdv = Rendezvous::Tcp {
            addr: "127.0.0.1".into(),
            port: free_port(),
        };
        let world = 4;
        let got: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let rdv = rdv.clone();
                    s.spawn(move || {
                        share_id(&rdv, rank, world, Duration::from_secs(20), || Ok(id(7)))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert!(got.iter().all(|g| *g == id(7)));
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let rdv = Rendezvous::Tcp {
            addr: "127.0.0.1".into(),
            port: free_port(),
        };
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

    #[test]
    fn file_rendezvous_round_trips() {
        let path = std::env::temp_dir().join(format!("lasp-rdv-test-{}", std::process::id()));
        let rdv = Rendezvous::File(path.clone());
        let reader = {
            let rdv = rdv.clone();
            std::thread::spawn(move || {
                share_id(&rdv, 1, 2, Duration::from_secs(10), || unreachable!())
            })
        };
        assert_eq!(
            share_id(&rdv, 0, 2, Duration::from_secs(10), || Ok(id(3))).unwrap(),
            id(3)
        );
        assert_eq!(reader.join().unwrap().unwrap(), id(3));
        std::fs::remove_file(path).unwrap();
    }
}
