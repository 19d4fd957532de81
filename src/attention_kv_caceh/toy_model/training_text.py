"""A few kilobytes of plain English, written for this project, that `make_model` trains its tokenizer on.

Fixed text, so the byte-level BPE that `write_random_checkpoint` trains is the same on every machine.

vLLM has no counterpart: it never trains a tokenizer; a checkpoint's `tokenizer.json` or GGUF vocabulary is
used as shipped.
"""

from __future__ import annotations

__all__ = ["TRAINING_TEXT"]

TRAINING_TEXT = """\
The lighthouse keeper woke before the sun, as he had done every morning for thirty years. He climbed the
narrow stairs, counted the steps out of habit, and trimmed the wick of the great lamp. The sea was calm
that day, grey and flat, and the gulls sat on the rocks below as if they were waiting for something.

In the village at the foot of the hill, the baker had already lit her oven. The smell of fresh bread
drifted along the harbour wall, past the boats and the nets hung out to dry. Children ran down the
street with their satchels, and an old dog followed them as far as the corner before it lay down in a
patch of early light.

The schoolmaster wrote a sentence on the board: "A journey of a thousand miles begins with a single
step." He asked the class what it meant. One boy said it meant that you should wear good shoes. A girl
by the window said it meant that large things are made of small ones, and that the hardest part is to
begin. The schoolmaster smiled and wrote her answer underneath.

A river runs from the mountains to the sea. In spring it is loud and fast, full of melted snow; in late
summer it is slow and warm, and you can see the stones on its bed. Farmers along its banks measure the
year by its moods. When the water is high they mend their fences; when it is low they mend their roofs.

Numbers are a kind of language too. One, two, three, four, five, six, seven, eight, nine, ten. Twenty
and thirty, a hundred and a thousand. If you add two and three you get five; if you multiply them you
get six. The merchant in the market counts coins all day and never loses track, though he cannot read a
word of the newspapers he wraps his fish in.

Winter came early that year. The first snow fell in the night, quietly, and by morning the roads were
white and the trees bent under the weight. People stayed inside and told stories by the fire: stories
of storms and shipwrecks, of lost travellers who found their way home by following a single light on
the cliff, of the keeper who never once let the lamp go out.

The library in the town hall had three rooms and a reading table by the stove. The librarian kept a
ledger of every book that went out and every book that came back. She said that a book which is never
read is like a letter which is never opened: it holds its news, but nobody learns it. On quiet
afternoons she read aloud to anyone who cared to listen, and there were always a few.

Questions are more useful than answers, the old keeper used to say. Why does the tide rise twice a day?
Why do the stars turn around one point in the north? How far away is the horizon, and why does a ship
disappear from the bottom up? He had found some answers in books and some by watching, and he wrote them
all down in a blue notebook that he kept on the shelf beside the lamp.

When he finally retired, he gave the notebook to the girl who had answered the schoolmaster's question
years before. She had grown up to study the sea and the sky. She read every page, added a few of her
own, and put it back on the shelf, where the next keeper would find it. The light still turns each
night, and ships still find their way home.
"""
