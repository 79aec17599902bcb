"""PromptEncoder: the texts of one loop round go to the tokenizer as one batch on a thread,
a lone short text is encoded inline, a long one in pieces, and every text gets the ids its
own encoding gives."""
import asyncio

import pytest

from serve_app.text.prompt_encoder import PromptEncoder

TEXTS = ["Hello there, how are you?", "Write a haiku about the sea.", "<|im_start|>user\nhi",
         "Compose an engaging travel blog post about a recent trip to Hawaii."]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def encoder(tokenizer):
    enc = PromptEncoder(tokenizer, inline_chars=100)
    yield enc
    enc.close()


def expected(tokenizer, text, special=False):
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=special).ids


def test_one_round_of_texts_is_one_batch(encoder, tokenizer):
    async def main():
        return await asyncio.gather(*(encoder.encode(t) for t in TEXTS))
    got = run(main())
    assert got == [expected(tokenizer, t) for t in TEXTS]
    assert (encoder.batches, encoder.batched_texts) == (1, len(TEXTS))


def test_a_lone_short_text_is_encoded_inline(encoder, tokenizer):
    got = run(encoder.encode(TEXTS[0]))
    assert got == expected(tokenizer, TEXTS[0])
    assert encoder.batches == 0


def test_a_lone_long_text_goes_to_the_thread(encoder, tokenizer):
    long = " ".join(TEXTS) * 10
    assert run(encoder.encode(long)) == expected(tokenizer, long)
    assert encoder.batches == 1


def test_a_long_prompt_is_encoded_in_pieces_with_the_whole_texts_ids(encoder, tokenizer):
    """A text of many pieces (serve_app/text/text_pieces.py) beside a short one, in one batch."""
    long = "".join(f"Line {i}: {TEXTS[i % len(TEXTS)]}\n" for i in range(2000))  # ~80k characters

    async def main():
        return await asyncio.gather(encoder.encode(long), encoder.encode(TEXTS[0]))
    assert len(encoder.pieces.cuts(long)) >= 5
    assert run(main()) == [expected(tokenizer, long), expected(tokenizer, TEXTS[0])]
    assert (encoder.batches, encoder.batched_texts) == (1, 2)


def test_special_tokens_flag_is_kept_per_text(encoder, tokenizer):
    async def main():
        return await asyncio.gather(encoder.encode(TEXTS[1], True), encoder.encode(TEXTS[1], False))
    with_special, without = run(main())
    assert with_special == expected(tokenizer, TEXTS[1], True)
    assert without == expected(tokenizer, TEXTS[1], False)


def test_a_cancelled_waiter_does_not_stop_the_others(encoder, tokenizer):
    async def main():
        first = asyncio.create_task(encoder.encode(TEXTS[0]))
        second = asyncio.create_task(encoder.encode(TEXTS[1]))
        await asyncio.sleep(0)  # both texts queued for the next round
        first.cancel()
        return await second
    assert run(main()) == expected(tokenizer, TEXTS[1])


def test_the_loop_runs_while_a_batch_encodes(encoder):
    """encode_batch releases the GIL: callbacks keep running while a big batch encodes."""
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = ticks
        await encoder.encode(" ".join(TEXTS) * 2000)  # ~60 ms of encoding on this CPU
        ticker.cancel()
        return ticks - before
    assert run(main()) > 100  # held, the GIL lets through a handful at most
