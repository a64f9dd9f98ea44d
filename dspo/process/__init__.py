"""What every command sets up before its work and how it ends: threads and allocator (`runtime`), one console
(`console`), errors a user can act on (`errors`), the data-folder resolver (`resources`). No Lightning."""
