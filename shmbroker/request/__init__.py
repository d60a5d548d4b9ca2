"""What a producer asks of an item beyond its tokens: its request options (`options.py`) and, for a
chat, the rendering of its messages with the model's own chat template (`chat.py`).

Both run on the producer's side (the client, `submit`, batch jobs): the broker's processes carry
options as opaque words with the item and never render anything. Only the engine that runs an item
reads its options. This room imports nothing else of the package.
"""
