"""Host-side clients: pool clients (blocking, asyncio), the torch DDP hook, the ring-host baseline's host side."""
