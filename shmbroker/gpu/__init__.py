"""GPU side: the consumer loop (a later issue) and the engines it runs."""
