"""The web demo's page in headless Chromium (Debian's chromium and chromedriver, driven by
selenium): upload a shapes image, see its caption, hover a word and see its heatmap; upload a
text file named .png and see the error. ``make test-browser`` installs the browser."""

import shutil

import pytest

import captioning
from captioning.serve.app import ServeSettings
from captioning.serve.server import BackgroundServer

pytestmark = pytest.mark.browser

# The heatmap canvas's least and most opaque pixels (0..255), read in the page.
ALPHA_RANGE = """
const canvas = document.getElementById('heatmap');
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
let low = 255, high = 0;
for (let i = 3; i < data.length; i += 4) {
  low = Math.min(low, data[i]);
  high = Math.max(high, data[i]);
}
return [low, high];
"""


def chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.fail("chromium and chromedriver are missing: `make test-browser` installs them")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1000,720",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def page(tiny_checkpoint, tiny_shapes):
    model = captioning.load(tiny_checkpoint, device="cpu")
    examples = sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))[:4]
    with BackgroundServer(model, ServeSettings(examples=tuple(examples))) as url:
        driver = chrome()
        try:
            driver.get(url)
            yield driver, model, examples
        finally:
            driver.quit()


def test_upload_caption_and_hover_a_word(page, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, model, examples = page
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: "soft attention" in d.find_element(By.ID, "model-info").text)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#examples img")) == 4
    assert not driver.find_element(By.ID, "mode-row").is_displayed()  # soft: no decode mode
    driver.find_element(By.ID, "file").send_keys(examples[0])
    words = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption .word"))
    expected = model.caption(examples[0])
    assert [w.text for w in words] == expected.words
    assert not driver.find_element(By.ID, "heatmap").is_displayed()

    index = min(1, len(words) - 1)
    before = words[index].location
    ActionChains(driver).move_to_element(words[index]).perform()
    heatmap = driver.find_element(By.ID, "heatmap")
    wait.until(lambda d: heatmap.get_attribute("data-word") == str(index))
    assert heatmap.is_displayed() and "active" in words[index].get_attribute("class")
    # showing the map and its legend moves nothing: a word that moved away from the pointer
    # would hide the map again at once
    assert words[index].location == before
    assert driver.find_element(By.ID, "legend").is_displayed()
    # the layer covers the whole photo (dimming it, lightening the peak by 15 %) and varies
    low, high = driver.execute_script(ALPHA_RANGE)
    assert 30 < low < high
    driver.save_screenshot(str(tmp_path / "page.png"))

    # an example thumbnail goes the same way
    driver.find_elements(By.CSS_SELECTOR, "#examples img")[1].click()
    wanted = model.caption(examples[1]).caption
    wait.until(lambda d: d.find_element(By.ID, "caption").get_attribute("data-caption") == wanted)


def test_a_text_file_named_png_shows_the_error(page, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, _, examples = page
    fake = tmp_path / "notes.png"
    fake.write_text("these are notes, not an image\n")
    driver.find_element(By.ID, "file").send_keys(str(fake))
    error = driver.find_element(By.ID, "error")
    WebDriverWait(driver, 60).until(lambda d: error.is_displayed())
    assert error.text == "notes.png: not a JPEG, PNG, WebP, GIF, BMP or TIFF image"
    assert driver.find_elements(By.CSS_SELECTOR, "#caption .word") == []
    # and the page still captions afterwards
    driver.find_element(By.ID, "file").send_keys(examples[2])
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption .word"))
    assert not error.is_displayed()


# The colour of the heatmap canvas on the left edge of the chosen cell of the shown word.
CHOSEN_CELL_EDGE = """
const canvas = document.getElementById('heatmap');
const [x, y, w, h] = imageBox(), [rows, cols] = result.grid;
const cell = result.cells[Number(canvas.dataset.word)];
const left = Math.round(x + (cell % cols) * w / cols);
const middle = Math.round(y + (Math.floor(cell / cols) + 0.5) * h / rows);
return Array.from(canvas.getContext('2d').getImageData(left, middle, 1, 1).data);
"""


def test_hard_attention_offers_decode_modes_and_outlines_the_chosen_cell(
    page, tiny_hard_checkpoint
):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver, _, examples = page
    hard = captioning.load(tiny_hard_checkpoint, device="cpu")
    with BackgroundServer(hard) as url:
        driver.get(url)
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "hard attention" in d.find_element(By.ID, "model-info").text)
        mode = Select(driver.find_element(By.ID, "mode"))
        assert "argmax" in [option.text for option in mode.options]
        mode.select_by_value("argmax")
        driver.find_element(By.ID, "file").send_keys(examples[0])
        words = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption .word"))
        assert [w.text for w in words] == hard.caption(examples[0], hard_context="argmax").words
        ActionChains(driver).move_to_element(words[0]).perform()
        wait.until(lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-word") == "0")
        assert driver.execute_script(CHOSEN_CELL_EDGE) == [255, 255, 255, 255]


def test_an_example_with_instances_outlines_the_objects_a_word_names(tiny_checkpoint, tiny_shapes):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model = captioning.load(tiny_checkpoint, device="cpu")
    example = sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))[0]
    first = model.caption(example).words[0]
    settings = ServeSettings(
        examples=(example,),
        category_words={first: "thing"},
        example_boxes=((("thing", (0.25, 0.25, 0.5, 0.5)),),),
    )
    with BackgroundServer(model, settings) as url:
        driver = chrome()
        try:
            driver.get(url)
            wait = WebDriverWait(driver, 60)
            heatmap = driver.find_element(By.ID, "heatmap")
            for choose, boxes in (("example", "1"), ("upload", "0")):
                if choose == "example":
                    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#examples img"))
                    driver.find_element(By.CSS_SELECTOR, "#examples img").click()
                else:
                    driver.find_element(By.ID, "file").send_keys(example)
                words = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption .word"))
                ActionChains(driver).move_to_element(words[0]).perform()
                wait.until(lambda d, want=boxes: heatmap.get_attribute("data-boxes") == want)
                legend = driver.find_element(By.ID, "legend").text
                assert ("Yellow: the annotated thing" in legend) == (boxes == "1")
                ActionChains(driver).move_to_element(driver.find_element(By.ID, "drop")).perform()
        finally:
            driver.quit()
