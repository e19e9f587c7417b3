//! Client-side token bucket, so a burst of work (a policy change touching thousands of
//! Deployments, a resync after an outage) cannot flood the SPIRE server with requests.

use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::Instant;

pub struct TokenBucket {
    /// Requests per second; `None` means unlimited.
    rate: Option<f64>,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// `rate` requests per second with bursts up to `burst`; `rate <= 0` disables limiting.
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            rate: (rate > 0.0).then_some(rate),
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Waits until a token is available and takes it.
    pub async fn acquire(&self) {
        let Some(rate) = self.rate else { return };
        loop {
            let wait = {
                let mut state = self.state.lock().await;
                let (tokens, last) = *state;
                let now = Instant::now();
                let refilled =
                    (tokens + now.duration_since(last).as_secs_f64() * rate).min(self.burst);
                if refilled >= 1.0 {
                    *state = (refilled - 1.0, now);
                    return;
                }
                *state = (refilled, now);
                Duration::from_secs_f64((1.0 - refilled) / rate)
            };
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bursts_then_paces_at_the_rate() {
        let bucket = TokenBucket::new(10.0, 5);
        let start = tokio::time::Instant::now();
        for _ in 0..5 {
            bucket.acquire().await;
        }
        assert!(
            start.elapsed() < Duration::from_millis(1),
            "the burst is free"
        );
        for _ in 0..10 {
            bucket.acquire().await;
        }
        let paced = start.elapsed();
        assert!(
            paced >= Duration::from_millis(950) && paced <= Duration::from_millis(1100),
            "{paced:?}"
        );
    }

    #[tokio::test]
    async fn zero_rate_is_unlimited() {
        let bucket = TokenBucket::new(0.0, 1);
        for _ in 0..10_000 {
            bucket.acquire().await;
        }
    }
}
