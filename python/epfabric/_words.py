"""32-bit words carried exactly through a bf16 dispatch: each word as 4 base-256 digits (bf16 holds 0..256
exactly), in rows of a multiple of 8 columns (the library's bf16 rows). A cached dispatch of such rows tells a
receiving rank where each row came from (source rank, token) or brings new weights for a routing, without a wider
payload in the library."""
import torch

_DIGITS = 4  # base-256 digits of a 32-bit value; bf16 holds 0..256 exactly
_ROW_ALIGNMENT = 8  # the library's bf16 rows are a multiple of 8 wide


def align(value: int, alignment: int) -> int:
    """`value` rounded up to a multiple of `alignment`."""
    return -(-value // alignment) * alignment


def encode_words(words: torch.Tensor) -> torch.Tensor:
    """32-bit words as bf16 rows that a dispatch carries exactly: each word as 4 base-256 digits.

    Arguments:
        words: `[num_tokens, k]` with `torch.int64` (values in [0, 2^32)).

    Returns:
        rows: `[num_tokens, align(4 k, 8)]` with `torch.bfloat16`, the digits then zeros.
    """
    num_tokens, k = words.shape
    shifts = torch.arange(0, 8 * _DIGITS, 8, device=words.device, dtype=torch.int64)
    digits = (words.unsqueeze(-1) >> shifts) & 0xFF
    rows = torch.zeros(num_tokens, align(k * _DIGITS, _ROW_ALIGNMENT), dtype=torch.bfloat16, device=words.device)
    rows[:, :k * _DIGITS] = digits.reshape(num_tokens, k * _DIGITS).to(torch.bfloat16)
    return rows


def decode_words(rows: torch.Tensor, k: int) -> torch.Tensor:
    """encode_words' inverse.

    Arguments:
        rows: `[num_rows, >= 4 k]` with `torch.bfloat16`.
        k: the words per row.

    Returns:
        words: `[num_rows, k]` with `torch.int64`.
    """
    digits = rows[:, :k * _DIGITS].float().round().to(torch.int64).reshape(rows.shape[0], k, _DIGITS)
    shifts = torch.arange(0, 8 * _DIGITS, 8, device=rows.device, dtype=torch.int64)
    return (digits << shifts).sum(-1)


def float_words(values: torch.Tensor) -> torch.Tensor:
    """`torch.float` values as their 32-bit patterns (int64 in [0, 2^32)), for encode_words."""
    return values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def words_float(words: torch.Tensor) -> torch.Tensor:
    """float_words' inverse."""
    return words.to(torch.int32).view(torch.float32)
